"""Training the head that reads the edge's layers (`splitlm.decoding.layer_head`), with its own outputs fed
back ("training-time test").

Data as `splitlm.decoding.train_head`: the model's own greedy answers (the warm-up file), every tenth
held out. The full model runs over each prompt + answer once and gives, per position, the three
features the split's edge holds there (layer K's output, layer L − M's, the final-normed state) and
the greedy next token. Each optimiser step takes whole sequences (up to `RING` tokens, the context the
head attends over when it drafts) and unrolls `steps` depths over every position at once
(`layer_head.unrolled`); the loss is the cross-entropy over the draft vocabulary of every depth's
prediction of the greedy token, on positions whose target is an answer token.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from splitlm.decoding.head import HEAD_FILE, cached_head_path, head_report_path, save_head
from splitlm.decoding.layer_head import RING, LayerHead, LayerHeadShape, unrolled
from splitlm.decoding.train_head import (
    REPORT_SCHEMA,
    answer_sequences,
    split_answers,
    training_dtype,
    training_inputs,
)
from splitlm.model.llama import embed
from splitlm.result_files import file_digest, provenance, time_stamp, write_json, write_result


@torch.inference_mode()
def layer_features(
    model, seqs: list[list[int]], layers: tuple[int, int], batch_tokens: int = 4096, progress=None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: the edge's features F [T, 3, D] (bf16: layer K's output, layer L − M's, the final
    normed state) and the greedy next tokens G [T]."""
    low_at, mid_at = layers
    caught: dict[int, torch.Tensor] = {}

    def catch(i):
        return lambda _module, _args, out: caught.__setitem__(i, out)

    hooks = [model.stack.layers[i - 1].register_forward_hook(catch(i)) for i in (low_at, mid_at) if i > 0]
    try:
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out: list = [None] * len(seqs)
        i = 0
        w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        while i < len(order):
            n = 1  # sorted by length: grow the group while its padded size fits
            while i + n < len(order) and (n + 1) * len(seqs[order[i + n]]) <= batch_tokens:
                n += 1
            group = order[i : i + n]
            t = max(len(seqs[j]) for j in group)
            ids = torch.tensor([seqs[j] + [0] * (t - len(seqs[j])) for j in group])  # right padding: causal, unseen
            x = embed(model.embed_tokens, ids, model.cfg)
            h = model.norm(model.stack(x, torch.arange(t)))  # [B, T, D]
            low = caught.get(low_at, x).float()
            mid = caught.get(mid_at, x).float()
            g = F.linear(h, w).argmax(-1)  # [B, T]
            feats = torch.stack([low, mid, h.float()], 2).to(torch.bfloat16)  # [B, T, 3, D]
            for r, j in enumerate(group):
                out[j] = (feats[r, : len(seqs[j])].clone(), g[r, : len(seqs[j])].clone())
            i += len(group)
            if progress is not None:
                progress.update(sum(len(seqs[j]) for j in group))
        return out
    finally:
        for hook in hooks:
            hook.remove()


@dataclass
class SequenceBatch:
    """Sequences padded to one length: features [B, T, 3, D], next tokens' ids [B, T] (x_{t+1} at t),
    targets [B, T] (the greedy token at t + 1, −100 where there is none) and answer starts."""

    feats: torch.Tensor
    nxt: torch.Tensor
    target: torch.Tensor
    starts: list[int]


def batches(data, seqs: list[list[int]], starts: list[int], batch_tokens: int) -> list[SequenceBatch]:
    """The sequences (cut at `RING`), grouped by length into padded batches of about `batch_tokens`."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out, i = [], 0
    while i < len(order):
        n = 1
        while i + n < len(order) and (n + 1) * min(RING, len(seqs[order[i + n]])) <= batch_tokens:
            n += 1
        group = order[i : i + n]
        t = min(RING, max(len(seqs[j]) for j in group))
        feats = torch.zeros(len(group), t, *data[group[0]][0].shape[1:], dtype=torch.bfloat16)
        nxt = torch.zeros(len(group), t, dtype=torch.long)
        target = torch.full((len(group), t), -100, dtype=torch.long)
        for r, j in enumerate(group):
            n_j = min(t, len(seqs[j]))
            feats[r, :n_j] = data[j][0][:n_j]
            x = torch.tensor(seqs[j][:n_j])
            nxt[r, : n_j - 1] = x[1:]
            target[r, : n_j - 1] = data[j][1][1:n_j]
            lo = max(starts[j] - 2, 0)  # targets x_{t+2} that are answer tokens
            target[r, :lo] = -100
        out.append(SequenceBatch(feats, nxt, target, [starts[j] for j in group]))
        i += len(group)
    return out


@dataclass(frozen=True)
class LayerHeadSettings:
    """How the head is trained: the data (`max_tokens` answer tokens), its size (`vocab` commonest greedy
    tokens, the MLP's `inner` width), the unrolled depths, and the optimiser's time limit, batch, rate and seed."""

    max_tokens: int = 1_000_000
    vocab: int = 8192
    inner: int = 1536
    steps: int = 4
    minutes: float = 40.0
    epochs: float = 4.0
    batch_tokens: int = 2048
    lr: float = 1e-3
    seed: int = 0
    start: str = "final"  # the layer starts as the identity on the final state (`start_from_final_state`;
    # 0.32 against 0.30 at depth 1 for "random" in 400 equal steps: docs/drafters.md)
    state_weight: float = 0.0  # > 0: also fit each output to the next position's final state (`batch_loss`)
    bf16: bool = True  # stored in bf16 (half the bytes; it drafts in bf16 where that is native)


def new_head(cfg, vocab_ids: torch.Tensor, layers: tuple[int, int], inner: int, start: str = "random") -> LayerHead:
    """A head at the model's width and attention shape, at its `start` (`LayerHeadSettings.start`)."""
    shape = LayerHeadShape(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, inner, 10000.0, cfg.rms_norm_eps
    )
    head = LayerHead(shape, vocab_ids, layers)
    return head.start_from_final_state() if start == "final" else head


def sub_vocab(head: LayerHead, vocab_size: int) -> torch.Tensor:
    """token id -> index in the head's vocabulary, −100 for the rest [V]."""
    sub_of = torch.full((vocab_size,), -100, dtype=torch.long)
    sub_of[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    return sub_of


def batch_loss(
    head: LayerHead, batch: SequenceBatch, emb, lm, sub_of, steps: int, state_weight: float = 0.0
) -> torch.Tensor:
    """The mean cross-entropy of every depth's predictions on the rows that have a chain that deep; with
    `state_weight`, plus that times a smooth-L1 loss between each output (read out through the head's norm)
    and the model's final-normed state at the next position (the MLP head's regulariser)."""
    states: list = []
    logits = unrolled(head, batch.feats, emb[batch.nxt], lm, steps, states if state_weight else None)
    target = sub_of[batch.target.clamp(min=0)].masked_fill(batch.target < 0, -100)  # [B, T]
    total = 0.0
    for j, lg in enumerate(logits):
        tj = target.clone()
        tj[:, :j] = -100  # no chain of depth j + 1 starts before the sequence
        total = total + F.cross_entropy(lg.float().flatten(0, 1), tj.flatten(), ignore_index=-100)
    if state_weight:
        high = batch.feats[:, 1:, 2].float()  # [B, T - 1, D] the final state at t + 1
        keep = (target[:, :-1] >= 0).float()[..., None]
        for j, o in enumerate(states):
            err = F.smooth_l1_loss(head.norm_out(o[:, :-1]).float(), high, reduction="none") * keep
            total = total + state_weight * err[:, j:].sum() / (keep[:, j:].sum() * high.shape[-1]).clamp(min=1)
    return total / len(logits)


@torch.inference_mode()
def acceptance(head: LayerHead, held: list[SequenceBatch], emb, lm, steps: int) -> dict:
    """On held-out sequences: for each depth, how often the head's top-1 equals the model's greedy token
    given every shallower depth of the same chain was right (conditional), the cumulative chance, and
    depth 1's top-4 hit rate. A chain starts at every position whose drafted tokens are answer tokens."""
    alive_n = [0] * steps
    hit_n = [0] * steps
    chains = 0
    top4 = 0
    for b in held:
        logits = unrolled(head, b.feats.float(), emb[b.nxt], lm, steps)
        ids = [head.vocab_ids[lg.argmax(-1)] for lg in logits]  # per depth [B, T]
        t = b.target.shape[1]
        valid = b.target[:, : t - steps + 1] >= 0  # chains starting at s with every depth's target there
        for j in range(steps):
            valid &= b.target[:, j : t - steps + 1 + j] >= 0
        alive = valid.clone()
        chains += int(valid.sum())
        t4 = head.vocab_ids[logits[0].topk(4, -1).indices][:, : t - steps + 1]  # [B, S, 4]
        top4 += int(((t4 == b.target[:, : t - steps + 1, None]).any(-1) & valid).sum())
        for j in range(steps):
            hit = ids[j][:, j : t - steps + 1 + j] == b.target[:, j : t - steps + 1 + j]
            alive_n[j] += int(alive.sum())
            alive = alive & hit
            hit_n[j] += int(alive.sum())
    cond = [h / max(a, 1) for h, a in zip(hit_n, alive_n, strict=True)]
    return {
        "positions": chains,
        "conditional": [round(c, 4) for c in cond],
        "cumulative": [round(h / max(chains, 1), 4) for h in hit_n],
        "top4_depth1": round(top4 / max(chains, 1), 4),
    }


def fit(
    head: LayerHead,
    train: list[SequenceBatch],
    emb: torch.Tensor,
    lm: torch.Tensor,
    sub_of: torch.Tensor,
    settings: LayerHeadSettings,
    bar=None,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """AdamW with a cosine rate over `epochs` passes of the batches, stopped at `minutes`; what it did."""
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.lr, weight_decay=0.0)
    total = max(1, int(len(train) * settings.epochs))
    deadline = time.perf_counter() + settings.minutes * 60
    rng = random.Random(settings.seed)
    order: list[int] = []
    done, loss_ema, loss_first = 0, None, None
    if bar is not None:
        bar.reset(total=total)
    while done < total and time.perf_counter() < deadline:
        if not order:
            order = list(range(len(train)))
            rng.shuffle(order)
        batch = train[order.pop()]
        warm = min(1.0, (done + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = settings.lr * warm * 0.5 * (1 + math.cos(math.pi * done / total))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=training_dtype() == torch.bfloat16):
            loss = batch_loss(head, batch, emb, lm, sub_of, settings.steps, settings.state_weight)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        done += 1
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        loss_first = loss_ema if loss_first is None else loss_first
        if bar is not None:
            bar.set_postfix(loss=f"{loss_ema:.3f}")
            bar.update(1)
    return {
        "steps": done,
        "planned_steps": total,
        "loss_first": round(loss_first or 0.0, 4),
        "loss_last": round(loss_ema or 0.0, 4),
    }


def train_layer_head(
    model_spec: str,
    edge_dir: str | Path,
    warmup: str | Path | None = None,
    settings: LayerHeadSettings = LayerHeadSettings(),
    log: Callable[[str], None] = lambda _: None,
    out: str | Path | None = None,
) -> dict:
    """Train the head for the split of `edge_dir` (its K and L − M), write it as
    EDGE_DIR/draft_head.safetensors and the model's copy in the cache, each with its report beside it
    (acceptance by depth on the held-out answers, data, settings, time, the command), and the report
    as `out/train-head-<stamp>.json` when `out` is given; return the report."""
    from tqdm import tqdm

    start = time.perf_counter()
    torch.manual_seed(settings.seed)
    edge_dir = Path(edge_dir)
    edge, path, records, model, tok = training_inputs(model_spec, edge_dir, warmup)
    layers = edge.manifest.cloud_layers
    seqs, starts = answer_sequences(records, tok, settings.steps)
    chosen, held_out = split_answers(seqs, starts, settings.max_tokens)
    keep = chosen + held_out
    n_tok = sum(min(RING, len(seqs[i])) for i in keep)
    log(
        f"{path}: {len(chosen)} answers to train on, {len(held_out)} held out; "
        f"features of layers {layers} on {n_tok} tokens"
    )
    with tqdm(total=n_tok, unit="tok", desc="features", leave=False) as bar:
        data = layer_features(model, [seqs[i][:RING] for i in keep], layers, progress=bar)
    feat_s = time.perf_counter() - start
    n = len(chosen)
    counts = torch.bincount(torch.cat([g for _, g in data[:n]]), minlength=model.cfg.vocab_size)
    vocab_ids = counts.topk(min(settings.vocab, model.cfg.vocab_size)).indices.sort().values
    coverage = float(counts[vocab_ids].sum() / counts.sum())
    head = new_head(model.cfg, vocab_ids, layers, settings.inner, settings.start)
    emb = model.embed_tokens.weight.detach().float() * model.cfg.embed_scale
    lm = (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach().float()[vocab_ids]
    sub_of = sub_vocab(head, model.cfg.vocab_size)
    del model
    train = batches(data[:n], [seqs[i] for i in chosen], [starts[i] for i in chosen], settings.batch_tokens)
    held = batches(data[n:], [seqs[i] for i in held_out], [starts[i] for i in held_out], settings.batch_tokens)
    del data
    with tqdm(unit="step", desc="train-head") as bar:
        fitted = fit(head, train, emb, lm, sub_of, settings, bar)
    head.eval()
    report = acceptance(head, held, emb, lm, settings.steps)
    head_out = edge_dir / HEAD_FILE
    save_head(head, head_out, torch.bfloat16 if settings.bf16 else None)
    cached = cached_head_path(edge.manifest.model_hash)
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(head_out, cached)
    doc = {
        "schema": REPORT_SCHEMA,
        "kind": "layers",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "head": str(head_out),
        "cached": str(cached),
        "head_sha256": file_digest(head_out),
        "head_bytes": head_out.stat().st_size,
        "model": model_spec,
        "model_hash": edge.manifest.model_hash,
        "feature_layers": list(layers),
        "warmup": str(path),
        "settings": asdict(settings),
        "reproduce": f"splitlm train-head --edge EDGE --model {model_spec} --max-tokens {settings.max_tokens} "
        f"--minutes {settings.minutes:g}"
        + (f" --warmup {warmup}" if warmup else "")
        + " (EDGE: a split with the same K and M)",
        "train_answers": len(chosen),
        "heldout_answers": len(held_out),
        "train_batches": len(train),
        **fitted,
        "vocab": len(vocab_ids),
        "vocab_coverage": round(coverage, 4),
        "heldout": report,
        "features_s": round(feat_s, 1),
        "seconds": round(time.perf_counter() - start, 1),
    }
    doc["provenance"] = provenance([head_out])
    for head_path in (head_out, cached):
        write_json(head_report_path(head_path), doc)
    if out is not None:
        write_result(out, "train-head", doc, stamp=time_stamp(doc["created"]))
    return doc
