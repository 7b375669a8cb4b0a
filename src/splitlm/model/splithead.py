"""The split-head topology: the LM head's vocabulary projection is split by hidden dimensions.

With W the LM head [V, D] and h the final normed hidden state of a token, the logits are
z = h·Wᵀ = h[:d]·W[:, :d]ᵀ + h[d:]·W[:, d:]ᵀ. The edge keeps W[:, :d] (with the embedding and
layers [0, K)); the cloud holds layers [K, L), the final norm and W[:, d:]. The cloud returns
h[:d] and its partial logits z_cloud = h[d:]·W[:, d:]ᵀ for the vocabulary rows the edge
authorised; the edge adds z_end = h[:d]·W[:, :d]ᵀ, masks every other id to −inf and decodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitlm import SplitLMError
from splitlm.model.config import ModelConfig
from splitlm.model.llama import softcap
from splitlm.model.weights import Piece


def check_d_end(cfg: ModelConfig, d_end: int | None) -> int:
    """The edge's share of the LM head's columns (default: half the hidden size)."""
    d_end = cfg.hidden_size // 2 if d_end is None else d_end
    if type(d_end) is not int or not 1 <= d_end < cfg.hidden_size:
        raise SplitLMError(f"--d-end must be an integer in [1, {cfg.hidden_size}) (the hidden size), got {d_end}")
    return d_end


def split_head_pieces(
    cfg: ModelConfig, edge: dict[str, Piece], cloud: dict[str, Piece], d_end: int
) -> tuple[dict[str, Piece], dict[str, Piece]]:
    """Move the final norm and W[:, d_end:] to the cloud; the edge keeps W[:, :d_end].

    `edge` arrives as the tail-local edge's tensors with no tail layers (tail = 0). A tied LM head
    stays the embedding on the edge (its first d_end columns are the edge's part)."""
    w = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"  # [V, D]
    cloud = {
        **cloud,
        "model.norm.weight": edge["model.norm.weight"],
        "lm_head.weight": Piece(w, (d_end, cfg.hidden_size)),
    }
    edge = {k: v for k, v in edge.items() if k not in ("model.norm.weight", "lm_head.weight")}
    if not cfg.tie_word_embeddings:
        edge["lm_head.weight"] = Piece(w, (0, d_end))  # [V, d_end]
    return edge, cloud


def cloud_head(model, h: torch.Tensor, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cloud's part of the LM head for the rows h [R, D] out of the last layer:
    (normed h[:, :d] [R, d], partial logits [R, S] for the authorised ids `vocab` [S] (None = all V))."""
    d = model.manifest.d_end
    hn = model.norm(h)  # [R, D]
    z = F.linear(hn[:, d:], model.lm_head.weight)  # [R, V]
    if vocab is not None:
        z = z.index_select(1, vocab)  # [R, S]
    return hn[:, :d], z


def edge_logits(
    model, h_end: torch.Tensor, z_cloud: torch.Tensor, vocab: torch.Tensor | None, w_end: torch.Tensor | None = None
) -> torch.Tensor:
    """Full logits [R, V] from the cloud's h[:d] [R, d] and partial logits [R, S]: z_end + z_cloud
    on the authorised ids `vocab` [S] (None = all), −inf elsewhere. `w_end`: W[vocab, :d], if the
    caller keeps it ([S, d]); computed here otherwise."""
    cfg = model.cfg
    dtype = model.end_weight.dtype
    if w_end is None:
        w_end = model.end_weight if vocab is None else model.end_weight.index_select(0, vocab)
    z = F.linear(h_end.to(dtype), w_end) + z_cloud.to(dtype)  # [R, S]
    z = softcap(z, cfg.final_logit_softcapping)
    if vocab is None:
        return z
    out = torch.full((z.shape[0], cfg.vocab_size), -torch.inf, dtype=z.dtype, device=z.device)
    out[:, vocab] = z
    return out
