"""The edge's own compute behind one interface (`EdgeBackend`): the head layers before a step goes
up (`head`), and after its reply comes back the rest of the model up to the asked rows' logits or
greedy candidates (`finish`). An `EdgeSession` calls its back end and never asks which it is.

- `TorchBackend`: tail-local on torch (`splitlm.model.shards.EdgeModel`): the tail layers, the final
  norm and the LM head (greedy steps through its screened head, `EdgeModel.greedy_head`).
- `OnnxBackend`: tail-local in ONNX Runtime (`splitlm.edge.onnx_runtime.OnnxEdge`, `--device onnx`):
  the tail graph ends in the LM head, so its replies carry no final hidden state.
- `SplitHeadBackend`: the split-head topology: no tail here; the cloud's h[:d] and partial logits
  over the authorised vocabulary complete the LM head (`splitlm.model.splithead.edge_logits`).

Each applies the edge's vocabulary subset (`splitlm.edge.vocab`) to what it returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from splitlm import SplitLMError
from splitlm.edge.adapters import apply_edge_adapter
from splitlm.edge.onnx_runtime import OnnxEdge, parse_onnx_device
from splitlm.edge.vocab import VocabSubset
from splitlm.model.config import ModelConfig
from splitlm.model.device import describe, resolve_device, resolve_dtype, to_device, to_host
from splitlm.model.kv_cache import KVCache
from splitlm.model.shards import EdgeModel, load_edge
from splitlm.model.splithead import edge_logits
from splitlm.transport.client import CloudClient
from splitlm.transport.codecs import wire_nbytes
from splitlm.transport.messages import RESULT_RESERVE_BYTES, Result

log = logging.getLogger(__name__)


@dataclass
class TailOut:
    """A step's outputs on the edge: `out` [R, V] logits, or with argmax each row's greedy id [R];
    with extras each row's k likeliest ids `topk` [R, k] and final-normed hidden state `hidden` [R, D]
    (None where the back end has none). Host tensors."""

    out: torch.Tensor
    topk: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    features: torch.Tensor | None = None  # [F, 3, D] the feature rows' head, cloud and final-normed states


class Block(Protocol):
    """What a back end reads of a block of new tokens (`splitlm.edge.link.Flight`)."""

    ids: list[int]  # T
    positions: list[int]  # [T]
    mask: torch.Tensor | None  # [T, T] visibility among the new tokens (None: causal)
    rows: list[int] | None  # the R rows whose outputs are asked for (None: all T)
    argmax: bool  # each row's greedy token instead of its logits
    extras: int  # k > 0: also each row's k likeliest ids and final hidden state
    allowed: torch.Tensor | None  # [R, V] bool: with argmax, each row's greedy token among these (a grammar's)
    feature_rows: list[int] | None  # the new tokens whose three hidden states come back (`TailOut.features`)
    h: torch.Tensor  # [T, D] the head layers' outputs


class EdgeBackend(Protocol):
    """What an edge session runs on the edge: embedding and head layers, then tail and LM head."""

    cfg: ModelConfig
    vocab: VocabSubset  # the ids the model may emit
    device: torch.device
    dtype: torch.dtype  # of the edge's layers
    max_logit_rows: int | None  # rows of logits one RESULT may hold (split-head), else None
    final_hidden: bool  # `finish` gives each row's final hidden state (what a trained draft head reads)
    hidden_down: bool  # a reply carries every new token's hidden state (tail-local), not only logits

    def new_caches(self) -> tuple[KVCache, KVCache]:
        """Empty (head, tail) caches for a new session."""

    def authorised(self) -> bytes | None:
        """The vocabulary the cloud is told at OPEN (split-head with a subset, packed), else None."""

    def connected(self, client: CloudClient, wire_dtype: str) -> None:
        """Learn the cloud's limits from the edge's first connection."""

    def head(self, ids: list[int], positions: list[int], mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
        """Embedding and head layers of T new tokens after `cache`: [T, D]."""

    def reply_rows(self, rows: list[int] | None) -> list[int] | None:
        """The rows the cloud computes logits for (split-head), or None: it sends hidden states."""

    def reply_elements(self, n_rows: int, sent: int) -> int:
        """The most elements a reply's tensor may hold, for a request of `sent` elements and `n_rows` rows."""

    def finish(self, reply: Result, f: Block, cache: KVCache) -> TailOut:
        """Block `f`'s reply through the rest of the model: the asked rows' outputs."""


def row_allowed(rows: torch.Tensor, vocab: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Per-row allowed ids [R, V] (a grammar's) and the edge's vocabulary subset [V] (None: all), on `device`."""
    rows = to_device(rows, device)
    return rows if vocab is None else rows & vocab


def masked_argmax(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Each row's greedy id [R] among its `allowed` [R, V] ids (None: all)."""
    if allowed is None:
        return logits.argmax(-1)
    return logits.masked_fill(~to_device(allowed, logits.device), -torch.inf).argmax(-1)


class LocalHead:
    """The embedding and head layers of an edge model (torch or ONNX Runtime), shared by every back end."""

    max_logit_rows: int | None = None
    final_hidden = False
    hidden_down = True

    def __init__(self, model: EdgeModel | OnnxEdge, vocab: VocabSubset, device: torch.device):
        self.model, self.vocab, self.device, self.cfg = model, vocab, device, model.cfg

    def new_caches(self) -> tuple[KVCache, KVCache]:
        return self.model.head.new_cache(), self.model.tail.new_cache()

    def authorised(self) -> bytes | None:
        return None

    def connected(self, client: CloudClient, wire_dtype: str) -> None:
        return None

    def head(self, ids: list[int], positions: list[int], mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
        dev = self.device
        return self.model.embed_and_head(
            torch.tensor([ids], device=dev),
            torch.tensor(positions, device=dev),
            None if mask is None else to_device(mask, dev),
            cache,
        )[0]  # [T, D]

    def reply_rows(self, rows: list[int] | None) -> list[int] | None:
        return None

    def reply_elements(self, n_rows: int, sent: int) -> int:
        return sent  # hidden states: as many as went up

    def tail_inputs(self, reply: Result, f: Block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The reply's hidden states [1, T, D] fp32, the block's positions [T] and mask, on the edge's device."""
        dev = self.device
        h = to_device(reply.hidden, dev, torch.float32)[None]
        return h, torch.tensor(f.positions, device=dev), None if f.mask is None else to_device(f.mask, dev)


class TorchBackend(LocalHead):
    """Tail-local on torch: tail layers, final norm and LM head (`EdgeModel`)."""

    final_hidden = True

    def __init__(self, model: EdgeModel, vocab: VocabSubset, device: torch.device):
        super().__init__(model, vocab, device)
        self.dtype = next(model.parameters()).dtype
        self.allowed = None if vocab.everything else to_device(vocab.allowed, device)  # [V] bool
        model.greedy_head()  # decides once whether its bf16 screen pays on this machine

    def finish(self, reply: Result, f: Block, cache: KVCache) -> TailOut:
        h, pos, mask = self.tail_inputs(reply, f)
        end = self.model.tail(h, pos, mask, cache)  # [1, T, D]
        normed = self.model.norm(end[0] if f.rows is None else end[0, f.rows])  # [R, D]
        features = None
        if f.feature_rows is not None:
            rows = f.feature_rows
            low = f.h[rows].float()
            features = to_host(torch.stack([low, h[0, rows].float(), self.model.norm(end[0, rows]).float()], 1))
        if f.argmax:
            allowed = self.allowed if f.allowed is None else row_allowed(f.allowed, self.allowed, self.device)
            logits, topk = self.model.greedy_head().candidates(normed, allowed, f.extras)
            logits = to_host(logits)
        else:
            logits = self.vocab.mask_logits(to_host(self.model.lm_logits(normed)))  # [R, V]
            topk = logits.topk(f.extras, -1).indices if f.extras else None
        hidden = to_host(normed) if f.extras else None
        return TailOut(logits, None if topk is None else to_host(topk), hidden, features)


class OnnxBackend(LocalHead):
    """Tail-local in ONNX Runtime on the CPU: the tail graph ends in the LM head (logits, no final hidden state)."""

    dtype = torch.float32

    def finish(self, reply: Result, f: Block, cache: KVCache) -> TailOut:
        h, pos, mask = self.tail_inputs(reply, f)
        full = self.vocab.mask_logits(self.model.tail_and_logits(h, pos, mask, cache, f.rows)[0])  # [R, V]
        topk = full.topk(f.extras, -1).indices if f.extras else None
        return TailOut(masked_argmax(full, f.allowed) if f.argmax else full, None if topk is None else to_host(topk))


class SplitHeadBackend(LocalHead):
    """Split-head: the cloud runs every remaining layer and its slice of the LM head; the edge completes
    the LM head with its own columns, over the authorised vocabulary only."""

    hidden_down = False

    def __init__(self, model: EdgeModel, vocab: VocabSubset, device: torch.device):
        super().__init__(model, vocab, device)
        self.dtype = next(model.parameters()).dtype
        # W[ids, :d], kept for the edge's life (a view when every id is allowed)
        self.vocab_ids = None if vocab.everything else to_device(vocab.ids, device)  # [S]
        w = model.end_weight
        self.w_end = w if self.vocab_ids is None else w.index_select(0, self.vocab_ids)  # [S, d]

    def authorised(self) -> bytes | None:
        return None if self.vocab.everything else self.vocab.packed()

    def connected(self, client: CloudClient, wire_dtype: str) -> None:
        """Rows of logits one RESULT may hold: what the frame limits (the client's and the cloud's) leave."""
        frame = min(client.max_frame_bytes, client.info.limits.max_frame_bytes or client.max_frame_bytes)
        per_row = wire_nbytes(wire_dtype, [1, self.vocab.size]) + wire_nbytes(
            wire_dtype, [1, self.model.manifest.d_end]
        )
        self.max_logit_rows = max(1, (frame - RESULT_RESERVE_BYTES) // per_row)

    def reply_rows(self, rows: list[int] | None) -> list[int] | None:
        return rows

    def reply_elements(self, n_rows: int, sent: int) -> int:
        return n_rows * self.vocab.size  # the rows' partial logits

    def logits(self, reply: Result, n_rows: int) -> torch.Tensor:
        """Logits [R, V] from a split-head RESULT: h[:d] [R, d] and partial logits [R, S]."""
        h_end, z = reply.hidden, reply.logits
        d, s = self.model.manifest.d_end, self.vocab.size
        if z is None or h_end.shape != (n_rows, d) or z.shape != (n_rows, s):
            raise SplitLMError(f"the cloud's split-head RESULT does not hold {n_rows} rows of h[:{d}] and {s} logits")
        return edge_logits(
            self.model, to_device(h_end, self.device), to_device(z, self.device), self.vocab_ids, self.w_end
        )

    def finish(self, reply: Result, f: Block, cache: KVCache) -> TailOut:
        logits = self.logits(reply, len(f.ids) if f.rows is None else len(f.rows))  # [R, V]
        cache.begin(len(f.ids))  # the (empty) tail cache stays in step with the head cache
        topk = to_host(logits.topk(f.extras, -1).indices) if f.extras else None
        return TailOut(to_host(masked_argmax(logits, f.allowed) if f.argmax else logits), topk)


def load_model(
    edge_dir: Path, device: str = "auto", dtype: str | None = "auto", edge_adapter: str | Path | None = None
) -> tuple[EdgeModel | OnnxEdge, torch.device]:
    """The edge shard's model and where it runs: torch on `device` in `dtype` (with a LoRA adapter merged),
    or with `device` onnx / onnx:int8 the graphs of `splitlm export-onnx` in ONNX Runtime on the CPU."""
    onnx = parse_onnx_device(device)  # None, or the precision of the ONNX Runtime graphs
    if not onnx:
        where = resolve_device(device)
        model = load_edge(edge_dir, where, resolve_dtype(dtype, where))
        if edge_adapter:
            apply_edge_adapter(model, edge_adapter)
        return model, where
    if dtype not in (None, "auto", "fp32"):
        raise SplitLMError(f"--device {device} sets the precision itself (onnx or onnx:int8); drop --dtype {dtype}")
    if edge_adapter:
        raise SplitLMError(
            "--edge-adapter is merged into the graphs at export: `splitlm export-onnx --edge DIR --edge-adapter PATH`"
        )
    return OnnxEdge(edge_dir, onnx), torch.device("cpu")  # the caches stay torch tensors in host memory


def make_backend(model: EdgeModel | OnnxEdge, vocab: VocabSubset, device: torch.device) -> EdgeBackend:
    """The back end that runs `model`: ONNX Runtime, split-head or tail-local torch."""
    if isinstance(model, OnnxEdge):
        backend: EdgeBackend = OnnxBackend(model, vocab, device)
        log.debug("edge layers in ONNX Runtime (CPU) %s", model.precision)
        return backend
    backend = SplitHeadBackend(model, vocab, device) if model.split_head else TorchBackend(model, vocab, device)
    log.debug("edge layers on %s", describe(device, backend.dtype))
    return backend
