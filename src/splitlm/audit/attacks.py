"""Attacks that turn activations back into tokens. Each returns ranked guesses [N, k] (global
token ids, best first) for N activations.

- `nn`: nearest embedding row by cosine similarity (needs only the public embedding matrix).
- `lens`: the logit lens, final norm + LM head applied to the hidden state.
- `probe`: learnt from activations of public text: `probe-linear` (ridge regression into the
  embedding space, then nearest embedding) and `probe-mlp` (an MLP classifier).
- `whitebox`: candidate search with the public weights: at each position try candidate tokens
  after the tokens recovered so far, keep the one whose activation is nearest (or, for an
  adaptive attacker, the one the defence makes likeliest: `score`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitlm.model.llama import LayerStack

CHUNK = 256


def l2_score(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Squared L2 distance of candidate activations h [b, n, D] to the observed ones [b, D] -> [b, n]."""
    return (h.float() - target[:, None].float()).pow(2).sum(-1)


def _topk_chunked(score_fn, h: torch.Tensor, k: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([score_fn(h[i : i + CHUNK]).topk(k, dim=-1).indices for i in range(0, h.shape[0], CHUNK)])


def rank_nn(h: torch.Tensor, embedding: torch.Tensor, k: int) -> torch.Tensor:
    """h [N, D], embedding [V, D] -> [N, k] by cosine similarity."""
    e = F.normalize(embedding.float(), dim=-1)
    return _topk_chunked(lambda x: F.normalize(x.float(), dim=-1) @ e.T, h, k)


def rank_lens(h: torch.Tensor, model, k: int) -> torch.Tensor:
    """h [N, D] -> [N, k] by the model's own final norm and LM head."""
    return _topk_chunked(lambda x: model.logits(x), h, k)


class LinearProbe:
    """Ridge regression from the (layer-normed) activation to the token's embedding row, then the
    nearest embedding by cosine: closed form, and it ranks every token, also ones never seen in training."""

    def __init__(self, h: torch.Tensor, y: torch.Tensor, embedding: torch.Tensor, ridge: float = 1.0):
        x = self._features(h)  # [N, D+1]
        gram = x.T @ x + ridge * torch.eye(x.shape[1])
        self.weight = torch.linalg.solve(gram, x.T @ embedding[y].float())  # [D+1, D]
        self.embedding = embedding

    @staticmethod
    def _features(h: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(h.float(), (h.shape[-1],))
        return torch.cat([h, torch.ones(h.shape[0], 1)], dim=1)

    def rank(self, h: torch.Tensor, k: int) -> torch.Tensor:
        return rank_nn(self._features(h) @ self.weight, self.embedding, k)


class MLPProbe(nn.Module):
    """A small MLP classifier over the tokens seen in training (it cannot name any other token)."""

    def __init__(self, embedding: torch.Tensor, vocab_ids: torch.Tensor, hidden: int = 1024):
        super().__init__()
        d = embedding.shape[1]
        self.register_buffer("vocab_ids", vocab_ids)  # [Vs] global ids of the classes
        self.body = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.out = nn.Parameter(embedding[vocab_ids].detach().float().clone())  # [Vs, D], starts at the embedding
        self.bias = nn.Parameter(torch.zeros(len(vocab_ids)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.body(h.float()) @ self.out.T + self.bias  # [N, Vs]

    def rank(self, h: torch.Tensor, k: int) -> torch.Tensor:
        self.eval()
        k = min(k, len(self.vocab_ids))
        return self.vocab_ids[_topk_chunked(self, h, k)]


def train_mlp_probe(
    h: torch.Tensor,
    y: torch.Tensor,
    embedding: torch.Tensor,
    epochs: int = 2,
    batch: int = 256,
    lr: float = 2e-3,
    seed: int = 0,
) -> MLPProbe:
    """Fit the MLP probe on activations h [N, D] of public text with tokens y [N]."""
    vocab_ids = torch.unique(y)
    probe = MLPProbe(embedding, vocab_ids)
    target = torch.searchsorted(vocab_ids, y)
    opt = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    steps = max(1, epochs * ((len(y) + batch - 1) // batch))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    probe.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), batch):
            idx = order[i : i + batch]
            loss = F.cross_entropy(probe(h[idx]), target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return probe.eval()


def merge_candidates(ranked: list[torch.Tensor], frequent: torch.Tensor, n: int, rows: int) -> torch.Tensor:
    """Per row, interleave the ranked lists [rows, k_i] (deduplicated), then frequent tokens: [rows, n]."""
    if not ranked:
        return frequent[:n].expand(rows, -1).clone()
    rows = []
    stacked = torch.stack(
        [r[:, j] for j in range(max(r.shape[1] for r in ranked)) for r in ranked if j < r.shape[1]], dim=1
    ).tolist()
    fill = frequent.tolist()
    for row in stacked:
        seen = dict.fromkeys(row)
        if len(seen) < n:
            for t in fill:
                seen.setdefault(t, None)
                if len(seen) >= n:
                    break
        rows.append(list(seen)[:n])
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def whitebox(
    stack: LayerStack | list[LayerStack],
    embed_fn,
    targets: torch.Tensor,
    candidates: torch.Tensor,
    k: int = 5,
    batch: int = 16,
    score=l2_score,
) -> torch.Tensor:
    """Recover sequences position by position from their activations.

    stack: the public layers that produced the activations (or several guesses of them: a
    candidate's score is its best over them); embed_fn: ids -> embeddings; targets [B, S, D];
    candidates [B, S, N]. Returns ranked guesses [B, S, k]: candidates sorted by `score` (default:
    the L2 distance) of their activation (after the recovered prefix) against the observed one.
    """
    stacks = stack if isinstance(stack, list) else [stack]
    out = []
    for b0 in range(0, targets.shape[0], batch):
        tgt, cand = targets[b0 : b0 + batch], candidates[b0 : b0 + batch]
        b, s, n = cand.shape
        caches = [st.new_cache() for st in stacks]
        ranked = torch.empty(b, s, min(k, n), dtype=torch.long)
        visible = torch.eye(n, dtype=torch.bool)  # each candidate sees the prefix and itself
        for t in range(s):
            x = embed_fn(cand[:, t])
            scores = torch.stack(
                [
                    score(st(x, torch.full((b, n), t), visible, c), tgt[:, t])
                    for st, c in zip(stacks, caches, strict=True)
                ]
            ).amin(0)  # [b, n]
            order = scores.argsort(dim=-1)
            ranked[:, t] = cand[:, t].gather(1, order[:, :k])
            for c in caches:
                c.keep_per_row(order[:, 0])
        out.append(ranked)
    return torch.cat(out)


def recovery(ranked: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """ranked [B, S, k] guesses, truth [B, S] -> top-1, top-5 and exact-sequence recovery."""
    hit1 = ranked[..., 0] == truth
    hit5 = (ranked[..., :5] == truth[..., None]).any(-1)
    return {
        "top1": hit1.float().mean().item(),
        "top5": hit5.float().mean().item(),
        "exact_seq": hit1.all(dim=1).float().mean().item(),
    }
