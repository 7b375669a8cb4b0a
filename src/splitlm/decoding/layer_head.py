"""A draft head that reads the edge's own layers (EAGLE-3's recipe on what a split edge holds).

At every position p the edge already has three hidden states of the target: after its K head layers
(low), the cloud's output (middle) and the final-normed state (high). The head fuses them,

    g_p = W_fuse · [low_p ; mid_p ; high_p]                                  # [D]

and runs one decoder layer whose input at p is [norm(e(x_{p+1})) ; norm(g_p)] (the next token's
embedding and the fused state) and whose attention reads the same layer's keys and values at the
earlier positions (a ring of the last `RING` positions on the edge). Its output o_p predicts the token
after x_{p+1} through the model's own LM head, restricted to the draft vocabulary (as `DraftHead`), and
stands in for g at the next position when the head drafts further: at depth j a node's row reads the
ring and its own ancestors' rows. Trained that way too ("training-time test",
`splitlm.decoding.train_layer_head`): each unrolled step feeds the head its own outputs.

The features belong to one split (K and L − M, kept in the file as `layers`): an edge split elsewhere
does not use the head (`fits`). Nothing new crosses the wire; the cloud never learns that a head exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitlm.model.llama import RMSNorm, rope_cos_sin, rotate_half

RING = 384  # positions of context the head attends over (its training sequences are at most this long)


@dataclass(frozen=True)
class LayerHeadShape:
    """The head's sizes: the model's width and attention shape, the MLP's inner width, RoPE and norms."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.hidden, self.heads, self.kv_heads, self.head_dim, self.inner], dtype=torch.long)

    @classmethod
    def from_tensor(cls, dims: torch.Tensor, theta: torch.Tensor, eps: torch.Tensor) -> LayerHeadShape:
        hidden, heads, kv_heads, head_dim, inner = (int(x) for x in dims.tolist())
        return cls(hidden, heads, kv_heads, head_dim, inner, float(theta), float(eps))


class LayerHead(nn.Module):
    def __init__(self, shape: LayerHeadShape, vocab_ids: torch.Tensor, layers: tuple[int, int]):
        super().__init__()
        d, qd, kd, eps = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.eps
        self.shape = shape
        self.fuse = nn.Linear(3 * d, d, bias=False)
        self.norm_e, self.norm_h = RMSNorm(d, eps), RMSNorm(d, eps)
        self.q, self.k, self.v = (
            nn.Linear(2 * d, qd, bias=False),
            nn.Linear(2 * d, kd, bias=False),
            nn.Linear(2 * d, kd, bias=False),
        )
        self.o = nn.Linear(qd, d, bias=False)
        self.norm_mlp = RMSNorm(d, eps)
        self.gate, self.up = nn.Linear(d, shape.inner, bias=False), nn.Linear(d, shape.inner, bias=False)
        self.down = nn.Linear(shape.inner, d, bias=False)
        self.norm_out = RMSNorm(d, eps)
        self.register_buffer("vocab_ids", vocab_ids.long())  # [S] the draft's vocabulary
        self.register_buffer("layers", torch.tensor(layers, dtype=torch.long))  # [2] K and L - M
        self.register_buffer("dims", shape.as_tensor())
        self.register_buffer("rope_theta", torch.tensor(shape.rope_theta, dtype=torch.float64))
        self.register_buffer("norm_eps", torch.tensor(shape.eps, dtype=torch.float64))
        self.path = None  # the file it was loaded from (`splitlm.decoding.head.load_head`)

    @torch.no_grad()
    def start_from_final_state(self) -> LayerHead:
        """Start as the identity on the final-normed state: the fusion picks `high`, the attention's and
        the MLP's output projections are zero, so o_p = high_p at first (as the MLP head's residual on
        the final state starts); training then moves it from there."""
        d = self.shape.hidden
        self.fuse.weight.zero_()
        self.fuse.weight[:, 2 * d :].copy_(torch.eye(d))
        self.o.weight.zero_()
        self.down.weight.zero_()
        return self

    @property
    def feature_layers(self) -> tuple[int, int]:
        """(K, L - M): the layers whose outputs it reads as low and middle features."""
        return int(self.layers[0]), int(self.layers[1])

    def fits(self, head_layers: int, cloud_end: int) -> bool:
        """Whether an edge with K = `head_layers` whose cloud ends at layer `cloud_end` gives its features."""
        return self.feature_layers == (head_layers, cloud_end)

    def fused(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [..., 3, D] (low, middle, high) -> g [..., D]."""
        return self.fuse(feats.flatten(-2).to(self.fuse.weight.dtype))

    def project(self, g: torch.Tensor, e: torch.Tensor, positions: torch.Tensor):
        """g, e [B, T, D], positions [T] or [B, T] -> q [B, H, T, hd], k, v [B, Hkv, T, hd]."""
        s = self.shape
        x = torch.cat([self.norm_e(e), self.norm_h(g)], -1)  # [B, T, 2D]
        b, t = x.shape[:2]
        q = self.q(x).view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        half = s.head_dim // 2
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, half, dtype=torch.float32, device=x.device) / half))
        cos, sin = rope_cos_sin(inv_freq, positions, q.dtype)  # [T, hd] or [B, T, hd]
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """g [B, T, D] (the residual), attn [B, H, T, hd] -> o [B, T, D]."""
        b, _, t, _ = attn.shape
        o = g + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        m = self.norm_mlp(o)
        return o + self.down(F.silu(self.gate(m)) * self.up(m))

    def readout(self, o: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
        """o [..., D], the draft vocabulary's LM-head rows lm [S, D] -> logits [..., S]."""
        return F.linear(self.norm_out(o), lm)

    def expand_kv(self, k: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, T, hd] -> [B, H, T, hd]."""
        rep = self.shape.heads // self.shape.kv_heads
        return k if rep == 1 else k.repeat_interleave(rep, 1)


def unrolled(head: LayerHead, feats, emb_next, lm, steps: int, states: list | None = None) -> list[torch.Tensor]:
    """Training-time test over whole sequences: feats [B, T, 3, D], emb_next [B, T, D] (the embedding of
    x_{t+1} at t) -> logits [B, T, S] for each of `steps` depths. At depth j the row at t stands for a
    drafted chain that left the context after position t - j + 1: its state is the head's own output
    at depth j - 1 one position back, and it attends over the real rows up to t - j + 1 and over its
    chain's rows (a diagonal of each deeper depth's keys). Rows t < j - 1 have no such chain."""
    b, t = feats.shape[:2]
    pos = torch.arange(t, device=feats.device)
    g = head.fused(feats)  # [B, T, D]
    keys, values, out = [], [], []
    scale = 1.0 / math.sqrt(head.shape.head_dim)
    for j in range(steps):
        if j:  # the state at t is depth j - 1's output at t - 1
            g = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1)
        q, k, v = head.project(g, emb_next, pos)
        keys.append(head.expand_kv(k))
        values.append(head.expand_kv(v))
        real = (pos[None, :] <= (pos[:, None] - j)).to(q.dtype)  # [T, T] real rows up to t - j
        scores = [(q @ keys[0].transpose(-1, -2)) * scale + torch.log(real)]  # [B, H, T, T]
        for i in range(1, j + 1):  # depth i's row of this chain: at t - (j - i)
            shifted = torch.roll(keys[i], j - i, 2)
            scores.append(((q * shifted).sum(-1, keepdim=True)) * scale)  # [B, H, T, 1]
        p = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
        attn = p[..., :t] @ values[0]
        for i in range(1, j + 1):
            attn = attn + p[..., t + i - 1 : t + i] * torch.roll(values[i], j - i, 2)
        o = head.finish(g, attn)
        out.append(head.readout(o, lm))
        if states is not None:  # each depth's outputs [B, T, D] (what stands in for the next position's state)
            states.append(o)
        g = o
    return out
