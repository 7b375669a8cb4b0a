"""`splitlm train-head`: train the edge's draft head (`splitlm.decoding.head`) on the model's own answers.

Data: the warm-up file's greedy answers (`splitlm warmup`; bundled for the default model), every
tenth answer held out. The full model (which the user holds anyway to split it) runs over each
prompt + answer once and gives, per position t, the final-normed hidden state H[t] and its greedy
next token G[t] (unless the warm-up kept them as it generated, `splitlm warmup --states`: then no second
pass). The head learns, from (H[t], the next token X[t+1]), to predict H[t+1] and G[t+1];
unrolled for `unroll` depths on its own predicted states, as it drafts. Loss: cross-entropy over
the head's vocabulary (the `vocab` commonest greedy tokens) plus a smooth-L1 feature term.
Nothing is sent anywhere; the head goes to EDGE_DIR/draft_head.safetensors (and a copy to the
model's entry under $SPLITLM_CACHE/heads, which later splits of the same model load).
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

from splitlm import SplitLMError
from splitlm.decoding.head import HEAD_FILE, DraftHead, cached_head_path, head_report_path, native_bf16, save_head
from splitlm.decoding.warmup import CapturedAnswer, captured_path, find_warmup, read_captured, read_warmup_records
from splitlm.model.llama import embed
from splitlm.model.loading import load_model
from splitlm.model.shards import load_edge
from splitlm.result_files import file_digest, provenance, time_stamp, write_json, write_result

REPORT_SCHEMA = "splitlm.train-head/1"


@torch.inference_mode()
def features(
    model, seqs: list[list[int]], batch_tokens: int = 4096, progress=None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: final-normed hidden states H [T, D] (bf16) and greedy next tokens G [T]."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list = [None] * len(seqs)
    i = 0
    while i < len(order):
        n = 1  # sorted by length: grow the group while its padded size fits
        while i + n < len(order) and (n + 1) * len(seqs[order[i + n]]) <= batch_tokens:
            n += 1
        group = order[i : i + n]
        t = max(len(seqs[j]) for j in group)
        ids = torch.tensor([seqs[j] + [0] * (t - len(seqs[j])) for j in group])  # right padding: causal, unseen
        w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        h = model.norm(model.stack(embed(model.embed_tokens, ids, model.cfg), torch.arange(t)))  # [B, T, D]
        g = F.linear(h, w).argmax(-1)  # [B, T]
        for r, j in enumerate(group):
            out[j] = (h[r, : len(seqs[j])].to(torch.bfloat16), g[r, : len(seqs[j])])
        i += len(group)
        if progress is not None:
            progress.update(sum(len(seqs[j]) for j in group))
    return out


class Batches:
    """Training positions (sequence, t): t from the answer's start, with `unroll` more positions after it."""

    def __init__(self, data, seqs, starts, unroll: int):
        self.data, self.unroll = data, unroll
        self.x = [torch.tensor(s) for s in seqs]
        self.pos = [
            (i, t)
            for i, (s, a) in enumerate(zip(seqs, starts, strict=True))
            for t in range(max(a - 1, 0), len(s) - 1 - unroll)
        ]

    def get(self, idx: list[tuple[int, int]]):
        """h0 [B, D], tokens [K, B], target tokens [K, B], target states [K, B, D]."""
        k = self.unroll
        h0 = torch.stack([self.data[i][0][t] for i, t in idx]).float()
        toks = torch.stack([self.x[i][t + 1 : t + 1 + k] for i, t in idx], 1)
        gt = torch.stack([self.data[i][1][t + 1 : t + 1 + k] for i, t in idx], 1)
        ht = torch.stack([self.data[i][0][t + 1 : t + 1 + k] for i, t in idx], 1).float()
        return h0, toks, gt, ht


def unrolled(head: DraftHead, emb: torch.Tensor, w: torch.Tensor, h0, toks):
    """Logits over the head's vocabulary [K, B, S] and predicted states [K, B, D], fed its own states."""
    h, logits, states = h0, [], []
    for k in range(toks.shape[0]):
        h = head(h, emb[toks[k]])
        states.append(h)
        logits.append(F.linear(h, w))
    return torch.stack(logits), torch.stack(states)


@torch.inference_mode()
def acceptance_by_depth(head, emb, w, batches: Batches, sub_of: torch.Tensor, limit: int = 20000) -> dict:
    """On held-out positions: for each depth d, how often the head's top-1 equals the model's greedy
    token given every shallower depth was right (the chance a drafted chain's d-th token is accepted
    once the (d-1)-th was), the cumulative chance, and depth 1's top-4 hit rate."""
    rng = random.Random(0)
    idx = rng.sample(batches.pos, min(limit, len(batches.pos)))
    h0, toks, gt, _ = batches.get(idx)
    logits, _ = unrolled(head, emb, w, h0, toks)
    pred = head.vocab_ids[logits.argmax(-1)]  # [K, B]
    alive = torch.ones(len(idx), dtype=torch.bool)
    cond, cum = [], []
    for k in range(pred.shape[0]):
        hit = (pred[k] == gt[k]) & alive
        cond.append(float(hit.sum()) / max(int(alive.sum()), 1))
        alive = hit
        cum.append(float(alive.float().mean()))
    top4 = head.vocab_ids[logits[0].topk(4, -1).indices]
    return {
        "positions": len(idx),
        "conditional": [round(c, 4) for c in cond],
        "cumulative": [round(c, 4) for c in cum],
        "top4_depth1": round(float((top4 == gt[0][:, None]).any(-1).float().mean()), 4),
    }


def answer_sequences(records: list[dict], tok, unroll: int) -> tuple[list[list[int]], list[int]]:
    """Token ids of each warm-up prompt + answer (cut at 384) and where its answer starts; answers
    shorter than `unroll` + 2 tokens are left out."""
    seqs, starts = [], []
    for r in records:
        p = tok(r["prompt"], add_special_tokens=False).input_ids
        a = tok(r["text"], add_special_tokens=False).input_ids
        if len(a) >= unroll + 2:
            seqs.append((p + a)[:384])
            starts.append(min(len(p), 383))
    return seqs, starts


def captured_sequences(
    records: list[dict], captured: dict[str, CapturedAnswer], unroll: int
) -> tuple[list[list[int]], list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """What `answer_sequences` and `features` give, from the states the warm-up kept as it generated: per
    answer (in the file's order, those long enough) the ids [N] as the head is fed them (a placeholder at the
    prompt's last position, then the answer), start 1, and (states [N, D], greedy tokens [N])."""
    seqs, starts, data = [], [], []
    for r in records:
        a = captured.get(r["prompt"])
        if a is None or len(a.ids) < unroll + 2:
            continue
        ids = a.ids.tolist()
        seqs.append([0, *ids[:-1]])
        starts.append(1)
        data.append((a.states, a.ids))
    return seqs, starts, data


def split_answers(seqs: list[list[int]], starts: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """(training answers, held-out answers) by index: every tenth answer is held out; training takes the
    others in order until `max_tokens` answer tokens, and as many held-out ones as a ninth of them."""
    held = [i for i in range(len(seqs)) if i % 10 == 0]
    train = [i for i in range(len(seqs)) if i % 10]
    budget, chosen = max_tokens, []
    for i in train:
        if budget <= 0:
            break
        chosen.append(i)
        budget -= len(seqs[i]) - starts[i]
    return chosen, held[: max(1, len(chosen) // 9)]


def training_dtype() -> torch.dtype:
    """What the full model's features and the head's products run in while training: bf16 where its
    products are native (`native_bf16`), else fp32 (an AVX2-only CPU emulates bf16 products, 6x slower
    than fp32 for the head's 512x576x1536 product)."""
    return torch.bfloat16 if native_bf16(torch.device("cpu")) else torch.float32


def training_inputs(model_spec: str, edge_dir: Path, warmup: str | Path | None):
    """What training a head for the edge shard in `edge_dir` reads: the shard, the warm-up file and its
    records, the full model (bf16; checked to be the shard's) and the tokenizer."""
    from transformers import AutoTokenizer

    edge = load_edge(edge_dir)
    if edge.split_head:
        raise SplitLMError("train-head needs a tail-local edge shard (split-head: the edge has no final hidden state)")
    path = Path(warmup) if warmup else find_warmup(edge_dir, edge.manifest.model_hash)
    if path is None:
        raise SplitLMError(f"no warm-up answers for {edge_dir}: run `splitlm warmup` first (or pass --warmup FILE)")
    records = read_warmup_records(path)
    dtype = training_dtype()
    model, model_dir = load_model(model_spec, dtype=dtype)
    if model.cfg.num_layers != edge.cfg.num_layers or not torch.equal(
        model.embed_tokens.weight.float(), edge.embed_tokens.weight.float().to(dtype).float()
    ):
        raise SplitLMError(f"{model_spec} is not the model the edge shard {edge_dir} was split from")
    tok = AutoTokenizer.from_pretrained(edge_dir if (edge_dir / "tokenizer.json").exists() else model_dir)
    return edge, path, records, model, tok


@dataclass(frozen=True)
class HeadSettings:
    """How the head is trained: the data (`max_tokens` answer tokens), its size (`vocab` commonest greedy
    tokens, `inner` width), the unrolled depths, and the optimiser's time limit, batch, rate and seed."""

    max_tokens: int = 1_000_000
    vocab: int = 8192
    inner: int = 1024
    unroll: int = 4
    minutes: float = 25.0
    batch: int = 256
    lr: float = 2e-3
    seed: int = 0


def train_head(
    model_spec: str,
    edge_dir: str | Path,
    warmup: str | Path | None = None,
    settings: HeadSettings = HeadSettings(),
    log: Callable[[str], None] = lambda _: None,
    out: str | Path | None = None,
) -> dict:
    """Train the head, write EDGE_DIR/draft_head.safetensors (and the model's copy in the cache), each with
    its report beside it (`X.json`: acceptance by depth on the held-out answers, data, settings, time,
    the command to reproduce it), and the report as `out/train-head-<stamp>.json` when `out` is given;
    return the report."""
    from tqdm import tqdm

    start = time.perf_counter()
    torch.manual_seed(settings.seed)
    edge_dir = Path(edge_dir)
    edge, path, records, model, tok = training_inputs(model_spec, edge_dir, warmup)
    captured = read_captured(captured_path(path))
    if captured:
        seqs, starts, states = captured_sequences(records, captured, settings.unroll)
    else:
        seqs, starts = answer_sequences(records, tok, settings.unroll)
    chosen, held_out = split_answers(seqs, starts, settings.max_tokens)
    keep = chosen + held_out
    n_tok = sum(len(seqs[i]) for i in keep)
    source = "their states as generated" if captured else f"full-model features on {n_tok} tokens"
    log(f"{path}: {len(chosen)} answers to train on, {len(keep) - len(chosen)} held out; {source}")
    if captured:
        data = [states[i] for i in keep]
    else:
        with tqdm(total=n_tok, unit="tok", desc="features", leave=False) as bar:
            data = features(model, [seqs[i] for i in keep], progress=bar)
    feat_s = time.perf_counter() - start
    ntrain = len(chosen)
    tr = Batches(data[:ntrain], [seqs[i] for i in chosen], [starts[i] for i in chosen], settings.unroll)
    ho = Batches(data[ntrain:], [seqs[i] for i in keep[ntrain:]], [starts[i] for i in keep[ntrain:]], settings.unroll)
    counts = torch.bincount(torch.cat([g for _, g in data[:ntrain]]), minlength=model.cfg.vocab_size)
    vocab_ids = counts.topk(min(settings.vocab, model.cfg.vocab_size)).indices.sort().values
    coverage = float(counts[vocab_ids].sum() / counts.sum())
    sub_of = torch.full((model.cfg.vocab_size,), -100, dtype=torch.long)  # token -> head vocabulary index
    sub_of[vocab_ids] = torch.arange(len(vocab_ids))
    d = model.cfg.hidden_size
    head = DraftHead(d, settings.inner, vocab_ids)
    emb = model.embed_tokens.weight.detach().float() * model.cfg.embed_scale
    w = (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach().float()[vocab_ids]
    del model
    opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0)
    steps = max(1, len(tr.pos) * 3 // settings.batch)  # three epochs at most, within the time limit
    deadline = time.perf_counter() + settings.minutes * 60
    rng = random.Random(settings.seed)
    done, loss_ema, loss_first = 0, None, None
    with tqdm(total=steps, unit="step", desc="train-head") as bar:
        while done < steps and time.perf_counter() < deadline:
            for g in opt.param_groups:
                g["lr"] = settings.lr * 0.5 * (1 + math.cos(math.pi * done / steps))
            h0, toks, gt, ht = tr.get(rng.sample(tr.pos, settings.batch))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=training_dtype() == torch.bfloat16):
                logits, states = unrolled(head, emb, w, h0, toks)
            ce = F.cross_entropy(logits.float().flatten(0, 1), sub_of[gt].flatten(), ignore_index=-100)
            feat = F.smooth_l1_loss(states.float(), ht)
            loss = ce + feat
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
            loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
            loss_first = loss_ema if loss_first is None else loss_first
            bar.set_postfix(loss=f"{loss_ema:.3f}")
            bar.update(1)
    head.eval()
    report = acceptance_by_depth(head, emb, w, ho, sub_of)
    head_out = edge_dir / HEAD_FILE
    save_head(head, head_out)
    cached = cached_head_path(edge.manifest.model_hash)  # what later splits of this model load
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(head_out, cached)
    doc = {
        "schema": REPORT_SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "head": str(head_out),
        "cached": str(cached),
        "head_sha256": file_digest(head_out),
        "model": model_spec,
        "model_hash": edge.manifest.model_hash,
        "warmup": str(path),
        "settings": asdict(settings),
        "reproduce": reproduce_command(model_spec, warmup, settings),
        "train_answers": len(chosen),
        "train_positions": len(tr.pos),
        "steps": done,
        "loss_first": round(loss_first or 0.0, 4),
        "loss_last": round(loss_ema or 0.0, 4),
        "vocab": len(vocab_ids),
        "vocab_coverage": round(coverage, 4),
        "heldout": report,
        "features": "captured by warmup --states" if captured else "full model over each prompt + answer",
        "features_s": round(feat_s, 1),
        "seconds": round(time.perf_counter() - start, 1),
    }
    doc["provenance"] = provenance([head_out])
    for head_path in (head_out, cached):  # the report next to each copy of the head
        write_json(head_report_path(head_path), doc)
    if out is not None:
        write_result(out, "train-head", doc, stamp=time_stamp(doc["created"]))
    return doc


def reproduce_command(model_spec: str, warmup: str | Path | None, settings: HeadSettings) -> str:
    """The `splitlm train-head` command line that trains a head like this one (EDGE: any split of the model)."""
    cmd = (
        f"splitlm train-head --edge EDGE --model {model_spec} --max-tokens {settings.max_tokens} "
        f"--minutes {settings.minutes:g}"
    )
    return cmd + (f" --warmup {warmup}" if warmup else "")


@torch.inference_mode()
def evaluate_head(
    model_spec: str,
    edge_dir: str | Path,
    head_path: str | Path,
    warmup: str | Path | None = None,
    max_tokens: int = 1_000_000,
    unroll: int = 4,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """A trained head's acceptance by depth on the answers `train_head` holds out with the same data and
    `max_tokens` (every tenth answer, as many as a ninth of the training answers): the report's `heldout`
    figures again, for a head whose report is lost. Runs the full model over the held-out answers only."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    start = time.perf_counter()
    edge_dir = Path(edge_dir)
    edge = load_edge(edge_dir)
    path = Path(warmup) if warmup else find_warmup(edge_dir, edge.manifest.model_hash)
    if path is None:
        raise SplitLMError(f"no warm-up answers for {edge_dir} (pass the warm-up file the head was trained on)")
    state = load_file(str(head_path))
    head = DraftHead(state["fc2.weight"].shape[0], state["fc2.weight"].shape[1], state["vocab_ids"])
    head.load_state_dict(state)
    head = head.float().eval()
    model, model_dir = load_model(model_spec, dtype=training_dtype())
    tok = AutoTokenizer.from_pretrained(edge_dir if (edge_dir / "tokenizer.json").exists() else model_dir)
    seqs, starts = answer_sequences(read_warmup_records(path), tok, unroll)
    _, held_out = split_answers(seqs, starts, max_tokens)
    log(
        f"{path}: {len(held_out)} held-out answers; full-model features on {sum(len(seqs[i]) for i in held_out)} tokens"
    )
    data = features(model, [seqs[i] for i in held_out])
    ho = Batches(data, [seqs[i] for i in held_out], [starts[i] for i in held_out], unroll)
    sub_of = torch.full((model.cfg.vocab_size,), -100, dtype=torch.long)
    sub_of[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    emb = model.embed_tokens.weight.detach().float() * model.cfg.embed_scale
    w = (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach().float()[head.vocab_ids]
    return {
        "head": str(head_path),
        "head_sha256": file_digest(head_path),
        "model": model_spec,
        "model_hash": edge.manifest.model_hash,
        "warmup": str(path),
        "heldout_answers": len(held_out),
        "heldout": acceptance_by_depth(head, emb, w, ho, sub_of),
        "seconds": round(time.perf_counter() - start, 1),
    }
