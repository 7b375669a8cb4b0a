"""`splitlm train-draft`: fit the self-draft's adapter from the full model on local text.

The self-draft skips the cloud's layers [K, L−M); the adapter maps the head layers' output h_K to
an estimate of h_{L−M}, the tail layers' real input. It is fitted by ridge regression (feature
distillation) on hidden states of the full model, which the user holds anyway to split it, over a
local corpus (default: Python's `pydoc_data.topics`); nothing is sent anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from splitlm import SplitLMError
from splitlm.decoding.corpus import default_corpus_documents
from splitlm.decoding.draft import ADAPTER_FILE, SelfDraft
from splitlm.model.loading import load_model
from splitlm.model.shards import load_edge
from splitlm.progress import bar


@torch.inference_mode()
def hidden_pairs(model, seqs: list[list[int]], k: int, j: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Outputs of layers k-1 and j-1 (h_k, h_j) [N, D] and the full model's argmax per sequence."""
    xs, ys, targets, grabbed = [], [], [], {}
    layers = model.stack.layers
    hooks = [layers[i - 1].register_forward_hook(lambda _m, _a, out, i=i: grabbed.__setitem__(i, out[0]))
             for i in (k, j)]
    try:
        for seq in seqs:
            logits = model(torch.tensor([seq]), torch.arange(len(seq)))[0]  # [T, V]
            xs.append(grabbed[k])
            ys.append(grabbed[j])
            targets.append(logits.argmax(-1))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(xs), torch.cat(ys), targets


def train_draft(model_spec: str, edge_dir: str | Path, max_tokens: int = 8000, ridge: float = 1.0,
                seq_len: int = 256, texts: list[str] | None = None, token_docs: list[list[int]] | None = None,
                progress: Callable[[str], None] = lambda _: None) -> dict:
    """Fit the adapter, write it to EDGE_DIR/draft_adapter.safetensors, report top-1 agreement on held-out text."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    start = time.perf_counter()
    edge_dir = Path(edge_dir)
    edge = load_edge(edge_dir)
    if getattr(edge, "split_head", False):
        raise SplitLMError("train-draft needs a tail-local edge shard (split-head keeps no tail layers)")
    model, model_dir = load_model(model_spec)
    if model.cfg.num_layers != edge.cfg.num_layers or not torch.equal(model.embed_tokens.weight,
                                                                      edge.embed_tokens.weight):
        raise SplitLMError(f"{model_spec} is not the model the edge shard {edge_dir} was split from")
    k, j = edge.manifest.head, edge.cfg.num_layers - edge.manifest.tail
    if token_docs is None:
        tokenizer = AutoTokenizer.from_pretrained(edge_dir if (edge_dir / "tokenizer.json").exists() else model_dir)
        token_docs = tokenizer(texts if texts is not None else default_corpus_documents()).input_ids
    seqs = [ids[i:i + seq_len] for ids in token_docs for i in range(0, len(ids), seq_len)]
    seqs = [s for s in seqs if len(s) >= 16]
    held = seqs[::10]  # every tenth chunk is held out
    train = [s for i, s in enumerate(seqs) if i % 10]
    budget, chosen = max_tokens, []
    for s in train:
        if budget <= 0:
            break
        chosen.append(s)
        budget -= len(s)
    held = held[: max(1, len(chosen) // 9)]
    stages = bar(3, "train-draft", unit="stage")
    progress(f"hidden states of layers {k} and {j} on {sum(map(len, chosen))} tokens ({len(chosen)} chunks)")
    x, y, _ = hidden_pairs(model, chosen, k, j)
    stages.update()
    xa = torch.cat([x, torch.ones(len(x), 1)], 1).double()  # [N, D+1]
    adapter = torch.linalg.solve(xa.T @ xa + ridge * torch.eye(xa.shape[1], dtype=torch.double),
                                 xa.T @ y.double()).float()  # [D+1, D]
    stages.update()
    progress(f"agreement with the full model on {sum(map(len, held))} held-out tokens")
    _, _, targets = hidden_pairs(model, held, k, j)
    scores = {}
    for name, a in (("raw", None), ("adapter", adapter)):
        draft, hits, total = SelfDraft(edge, a), 0, 0
        for seq, tgt in zip(held, targets, strict=True):
            pred = draft.logits(seq, list(range(len(seq))), draft.new_state()).argmax(-1)
            hits += int((pred == tgt).sum())
            total += len(seq)
        scores[name] = hits / total
    stages.update()
    stages.close()
    path = edge_dir / ADAPTER_FILE
    save_file({"adapter": adapter.contiguous()}, str(path))
    return {"adapter": str(path), "train_tokens": int(len(x)), "heldout_tokens": sum(map(len, held)),
            "top1_agreement_raw": round(scores["raw"], 4), "top1_agreement_adapter": round(scores["adapter"], 4),
            "seconds": round(time.perf_counter() - start, 1)}
