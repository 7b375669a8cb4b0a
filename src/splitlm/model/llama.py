"""Compact Llama-family transformer (Llama, Mistral, SmolLM, Qwen2, Gemma 3): RMSNorm, RoPE, GQA, SwiGLU.

What sets a family apart comes as traits of `ModelConfig` (scaled embedding, norm offset, q/k
norms, sandwich norms, sliding windows, logit soft-cap), never as a question of which family it is.

Parameter names follow Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`, ...) so that
weights load without renaming. Every forward takes explicit positions and an explicit
[T, T] visibility mask among the T new tokens; everything already in the cache is visible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from splitlm.model.config import ModelConfig
from splitlm.model.kv_cache import KVCache
from splitlm.model.linear import Linear, project
from splitlm.model.padded import Padding, padding_pays
from splitlm.model.paged_kv import PagedKVCache, PagedPass, shared_pool

SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class RMSNorm(nn.Module):
    """RMSNorm in float32, output in the weights' dtype (what the next matmul reads); with `offset`
    (Gemma's variant) it scales by (1 + weight) in float32."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (y * (1.0 + self.weight.float())).to(dtype)
        return self.weight * y.to(dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3 or linear scaling when configured
    (`local`: Gemma 3's sliding-window layers, own base, never scaled)."""
    dim = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = None if local else cfg.rope_scaling
    if not scaling:
        return inv_freq
    if scaling.get("rope_type") == "linear":
        return inv_freq / scaling["factor"]
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    freqs = positions[..., None].float() * inv_freq  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd]
    return x * cos + rotate_half(x) * sin


@dataclass
class Part:
    """One sequence of a (packed) pass: its T rows' rotary tables and masks, and its cache."""

    t: int
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]  # local (Gemma's sliding layers)? -> (cos, sin) [B, T, hd]
    masks: dict[int | None, torch.Tensor]  # sliding window (None = full attention) -> [1, 1, T, S+T] bool
    cache: KVCache | PagedKVCache | None

    @property
    def shape(self) -> tuple[int, int]:
        """(T new rows, S+T keys): the part's attention problem."""
        return self.t, self.masks[None].shape[-1]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias, qkv_bias = cfg.attention_bias, cfg.attention_bias or cfg.qkv_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.hd, bias=qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=qkv_bias)
        self.o_proj = Linear(self.n_heads * self.hd, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None

    def forward(
        self,
        x: torch.Tensor,
        parts: list[Part],
        layer: int,
        window: int | None = None,
        local: bool = False,
        padding: Padding | PagedPass | None = None,
    ) -> torch.Tensor:
        """x [B, N, D]: the rows of one or more sequences packed along dim 1 (`parts`, in order).
        The projections run once over all N rows; rotary embedding, the cache and attention per part,
        or, with `padding`, once for all of them (`splitlm.model.padded`); with a `PagedPass` (paged
        caches of one pool) the cache writes and reads go once for all parts (`splitlm.model.paged_kv`).
        `layer`: the index in the caches; `window`: the layer's sliding window; `local`: its own rotary base."""
        b = x.shape[0]
        q_all, k_all, v_all = project(x, self.q_proj, self.k_proj, self.v_proj)  # [B, N, H*hd], [B, N, Hkv*hd] x2
        if isinstance(padding, PagedPass):
            return self.o_proj(self.attend_paged(q_all, k_all, v_all, parts, padding, layer, window, local))
        if padding is not None:
            return self.o_proj(self.attend_padded(q_all, k_all, v_all, padding, layer, window, local))
        ys, start = [], 0
        for part in parts:
            t = part.t
            q = q_all.narrow(1, start, t).reshape(b, t, self.n_heads, self.hd).transpose(1, 2)  # [B, H, T, hd]
            k = k_all.narrow(1, start, t).reshape(b, t, self.n_kv, self.hd).transpose(1, 2)  # [B, Hkv, T, hd]
            v = v_all.narrow(1, start, t).reshape(b, t, self.n_kv, self.hd).transpose(1, 2)
            ys.append(self.attend(q, k, v, part.rope[local], part.masks[window], part.cache, layer))
            start += t
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)  # [B, N, H*hd]
        return self.o_proj(y)

    def attend(self, q, k, v, rope, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        """One sequence: q [B, H, T, hd], k and v [B, Hkv, T, hd] -> [B, T, H*hd]."""
        b, _, t, _ = q.shape
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, Hkv, S+T, hd]
        return self.sdpa(q, k, v, mask).transpose(1, 2).reshape(b, t, -1)

    def attend_padded(
        self, q_all, k_all, v_all, padding: Padding, layer: int, window: int | None, local: bool
    ) -> torch.Tensor:
        """Every sequence of a pass at once: q_all [1, N, H*hd], k_all and v_all [1, N, Hkv*hd] -> [1, N, H*hd]."""
        n = q_all.shape[1]
        q = q_all.view(1, n, self.n_heads, self.hd).transpose(1, 2)  # [1, H, N, hd]
        k = k_all.view(1, n, self.n_kv, self.hd).transpose(1, 2)  # [1, Hkv, N, hd]
        v = v_all.view(1, n, self.n_kv, self.hd).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = padding.rope[local]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_pad, v_pad = padding.write_and_gather(layer, k, v)  # [P, Hkv, S_max, hd] each
        return padding.unpad(self.sdpa(padding.pad_queries(q), k_pad, v_pad, padding.masks[window]))

    def attend_paged(
        self, q_all, k_all, v_all, parts: list[Part], paged: PagedPass, layer: int, window: int | None, local: bool
    ) -> torch.Tensor:
        """Every sequence of a pass, caches paged in one pool: one write and one gather of the layer's
        keys and values, then attention per part on views of the gather (or one padded call).
        q_all [1, N, H*hd], k_all and v_all [1, N, Hkv*hd] -> [1, N, H*hd]."""
        n = q_all.shape[1]
        q = q_all.view(1, n, self.n_heads, self.hd).transpose(1, 2)  # [1, H, N, hd]
        k = k_all.view(1, n, self.n_kv, self.hd).transpose(1, 2)  # [1, Hkv, N, hd]
        v = v_all.view(1, n, self.n_kv, self.hd).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = paged.rope[local]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv = paged.write_and_gather(layer, k, v)  # [sum S_i, 2, Hkv, hd], or [P, S_max, 2, Hkv, hd] padded
        pad = paged.padding
        if pad is not None:
            k_pad, v_pad = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [P, Hkv, S_max, hd]
            return pad.unpad(self.sdpa(pad.pad_queries(q), k_pad, v_pad, pad.masks[window]))
        ys, start = [], 0
        for i, part in enumerate(parts):
            k_i, v_i = paged.keys(kv, i)  # [1, Hkv, S_i, hd]
            y = self.sdpa(q.narrow(2, start, part.t), k_i, v_i, part.masks[window])  # [1, H, T_i, hd]
            ys.append(y.transpose(1, 2).reshape(1, part.t, -1))
            start += part.t
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)

    def sdpa(self, q, k, v, mask) -> torch.Tensor:
        """q [B, H, T, hd], k and v [B, Hkv, S, hd], mask [B or 1, 1, T, S] -> [B, H, T, hd]."""
        if SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        rep = self.n_heads // self.n_kv  # torch < 2.5: repeat the key/value heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(d, f, bias=bias)
        self.up_proj = Linear(d, f, bias=bias)
        self.down_proj = Linear(f, d, bias=bias)
        self.act = partial(F.gelu, approximate="tanh") if cfg.hidden_act.startswith("gelu") else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)  # [B, N, F] each
        return self.down_proj(self.act(gate) * up)


class Block(nn.Module):
    """Llama: x + attn(norm(x)), then + mlp(norm(x)) (`post_attention_layernorm` is the MLP's pre-norm).
    With `sandwich_norms` (Gemma 3) each of attention and MLP is wrapped in a pre- and a post-norm.

    The residual stream is float32 whatever the weights' dtype: in bf16/fp16 only the matmuls and
    the KV cache are reduced-precision (teacher-forced agreement with the fp32 model rises, e.g.
    98.7 % -> 99.4 % for SmolLM2 with a bf16 cloud); in fp32 nothing changes."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = RMSNorm(d, eps, offset)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(d, eps, offset)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(d, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(d, eps, offset)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x,
        parts: list[Part],
        layer: int,
        window: int | None = None,
        local: bool = False,
        padding: Padding | PagedPass | None = None,
    ) -> torch.Tensor:
        x = x.float()  # [B, N, D]: every part's rows (norms and MLP are row-wise)
        attn = self.self_attn(self.input_layernorm(x), parts, layer, window, local, padding)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


def embed(table: nn.Embedding, ids: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    x = table(ids)  # [B, T, D]
    if cfg.embed_scale != 1.0:  # Gemma: sqrt(D), rounded to the weights' dtype
        x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype, device=x.device)
    return x


def final_norm(cfg: ModelConfig) -> RMSNorm:
    """The norm before the LM head, [..., D] -> [..., D]."""
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if not cap else torch.tanh(logits / cap) * cap


def causal_mask(t: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()  # [T, T]


def full_mask(new_mask: torch.Tensor, past: int, device: torch.device | None = None) -> torch.Tensor:
    """[T, T] visibility among new tokens -> [1, 1, T, past + T] on `device` (all past entries visible)."""
    t = new_mask.shape[0]
    mask = torch.ones(1, 1, t, past + t, dtype=torch.bool, device=device)
    mask[0, 0, :, past:] = new_mask
    return mask


class LayerStack(nn.Module):
    """Layers [start, end) of the model. Its weights are named `model.layers.{i}.*` (global i)."""

    def __init__(self, cfg: ModelConfig, start: int, end: int):
        super().__init__()
        self.cfg, self.start, self.end = cfg, start, end
        self.layers = nn.ModuleList(Block(cfg) for _ in range(start, end))
        self.windows = [cfg.layer_window(i) for i in range(start, end)]  # None = full attention
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg, local=True), persistent=False)
        self.local_rope = [cfg.rope_local_theta is not None and w is not None for w in self.windows]
        self.pad_attention: bool | None = None  # one attention call per pass: None = on a GPU (`pads`)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers))

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        positions: torch.Tensor,  # [B, T] or [T]
        new_mask: torch.Tensor | None = None,  # [T, T] bool, None = causal
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        return self.forward_packed([x], [positions], [new_mask], [cache])[0]

    def forward_packed(
        self,
        xs: list[torch.Tensor],  # per sequence [B, T_i, D]
        positions: list[torch.Tensor],  # per sequence [B, T_i] or [T_i]
        new_masks: list[torch.Tensor | None],  # per sequence [T_i, T_i] bool, None = causal
        caches: list[KVCache | PagedKVCache | None],
    ) -> list[torch.Tensor]:
        """Several independent sequences in one pass: their rows are packed ([B, sum T_i, D]) for
        the norms, projections and MLP; rotary tables, masks, caches and attention stay per sequence.
        Returns each sequence's output [B, T_i, D]."""
        if len(self.layers) == 0:
            for x, cache in zip(xs, caches, strict=True):
                if cache is not None:
                    cache.begin(x.shape[1])
            return list(xs)
        parts = [self.plan(x, p, m, c) for x, p, m, c in zip(xs, positions, new_masks, caches, strict=True)]
        x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)  # [B, N, D]
        padding = self.layout(parts, x)
        for i, layer in enumerate(self.layers):
            x = layer(x, parts, i, self.windows[i], self.local_rope[i], padding)
        return [x] if len(xs) == 1 else list(x.split([p.t for p in parts], dim=1))

    def layout(self, parts: list[Part], x: torch.Tensor) -> Padding | PagedPass | None:
        """How the pass attends: per part on its own cache (None), padded to one call (`Padding`), or,
        when every part's cache is paged in one pool, through one write and one gather per layer."""
        padding = Padding.of(parts, x.device) if self.pads(parts, x) else None
        if x.shape[0] == 1 and shared_pool([p.cache for p in parts]) is not None:
            return PagedPass.of(parts, padding)
        return padding

    def pads(self, parts: list[Part], x: torch.Tensor) -> bool:
        """Whether a pass attends for all its sequences in one padded call (`splitlm.model.padded`): for
        two or more sequences of one row each, every one with its cache; by default (`pad_attention`
        None) on a GPU, where launches cost more than padding, unless the pad would be most of the work."""
        if len(parts) < 2 or x.shape[0] != 1 or any(p.cache is None for p in parts):
            return False
        if self.pad_attention is None:
            return x.is_cuda and padding_pays([p.shape for p in parts])
        return self.pad_attention

    def plan(
        self, x: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor | None, cache: KVCache | None
    ) -> Part:
        """One sequence's rotary tables and masks (per window), its append begun in `cache`."""
        t, dev = x.shape[1], x.device
        positions = (positions.view(1, -1) if positions.dim() == 1 else positions).to(dev)  # [B or 1, T]
        new_mask = causal_mask(t, dev) if new_mask is None else new_mask
        past = 0 if cache is None else cache.length
        mask = full_mask(new_mask, past, dev)  # [1, 1, T, S+T]
        if cache is not None:
            cache.begin(t, positions[0])
        key_positions = positions[0] if cache is None else cache.positions.to(dev)  # [S+T]
        masks = {None: mask}  # per sliding window: also hide keys `window` or more positions back
        for w in set(self.windows) - {None}:
            masks[w] = mask & (positions[0][:, None] - key_positions[None, :] < w)
        dtype = self.layers[0].input_layernorm.weight.dtype  # the tables meet q and k, not the residual stream
        rope = {False: rope_cos_sin(self.inv_freq, positions, dtype)}
        if any(self.local_rope):
            rope[True] = rope_cos_sin(self.inv_freq_local, positions, dtype)
        return Part(t, rope, masks, cache)


class Transformer(nn.Module):
    """The whole model in one process: embedding, all layers, final norm, LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.stack = LayerStack(cfg, 0, cfg.num_layers)
        self.norm = final_norm(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return softcap(F.linear(self.norm(h), w), self.cfg.final_logit_softcapping)

    def forward(self, ids, positions, new_mask=None, cache=None) -> torch.Tensor:
        x = embed(self.embed_tokens, ids, self.cfg)
        return self.logits(self.stack(x, positions, new_mask, cache))  # [B, T, V]
