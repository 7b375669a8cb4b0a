"""The edge's layers in ONNX Runtime (`--device onnx`, `--device onnx:int8`), CPU execution provider.

`OnnxEdge` stands in for `splitlm.model.shards.EdgeModel` behind the edge's back-end interface
(`splitlm.edge.backends.OnnxBackend`: `embed_and_head`, `tail_and_logits`, `head.new_cache()`,
`tail.new_cache()`):
the graphs of `splitlm.model.onnx_export` compute, the KV caches stay torch `KVCache`s here, so
speculative trees keep and crop entries exactly as on the torch edge. Each call hands the graph
the cache's entries so far and appends the new ones it returns.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from splitlm import SplitLMError
from splitlm.model.config import ModelConfig
from splitlm.model.kv_cache import KVCache
from splitlm.model.llama import causal_mask, full_mask
from splitlm.model.loading import read_hf_config
from splitlm.model.onnx_export import OnnxManifest, graph_file
from splitlm.model.shards import Manifest

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "int8")


class _Segment:
    """One graph, the number of layers (caches) it holds and their K/V shape (H_kv, head_dim)."""

    def __init__(self, path: Path, n_layers: int, kv_shape: tuple[int, int], threads: int | None):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.n_layers, self.kv_shape, self.path = n_layers, kv_shape, path
        self.inputs = {
            i.name for i in self.session.get_inputs()
        }  # (a graph without layers drops what it does not read)

    def new_cache(self) -> KVCache:
        return KVCache(self.n_layers)

    def run(
        self,
        feeds: dict[str, np.ndarray],
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        t: int,
    ) -> np.ndarray:
        """Feed the mask, positions and past entries of `cache`; append the new entries; the first output."""
        past = 0 if cache is None else cache.length
        new_mask = causal_mask(t) if mask is None else mask.cpu()
        positions = positions.reshape(-1).cpu().long()  # [T]
        for i in range(
            self.n_layers
        ):  # the S entries so far, [1, Hkv, S, hd] (a copy: ONNX Runtime reads dense arrays)
            view = None if cache is None or not past else cache.view(i)
            if view is None:
                k = v = np.zeros((1, self.kv_shape[0], 0, self.kv_shape[1]), dtype=np.float32)
            else:
                k, v = (x.float().contiguous().numpy() for x in view)
            feeds[f"past_k_{i}"], feeds[f"past_v_{i}"] = k, v
        if cache is not None:
            cache.begin(t, positions)
            keys = cache.positions.cpu()  # [S+T]
        else:
            keys = positions
        feeds.update(
            positions=positions.numpy(), mask=full_mask(new_mask, past)[0, 0].numpy(), key_positions=keys.numpy()
        )
        out = self.session.run(None, {k: v for k, v in feeds.items() if k in self.inputs})
        if cache is not None:
            for i in range(self.n_layers):
                cache.update(i, torch.from_numpy(out[1 + 2 * i]), torch.from_numpy(out[2 + 2 * i]))
        return out[0]


class OnnxEdge:
    """The edge model of one shard, run by ONNX Runtime in `precision` (fp32 or int8)."""

    split_head = False

    def __init__(self, edge_dir: str | Path, precision: str = "fp32", threads: int | None = None):
        if precision not in PRECISIONS:
            raise SplitLMError(f"unknown ONNX precision {precision!r} (choose from {', '.join(PRECISIONS)})")
        edge_dir = Path(edge_dir)
        self.manifest = Manifest.read(edge_dir, "edge")
        self.cfg = ModelConfig.from_hf(read_hf_config(edge_dir))
        onnx = OnnxManifest.read(edge_dir)
        if onnx.fingerprint != self.manifest.fingerprint:
            raise SplitLMError(f"{edge_dir}: the ONNX export is of another split; run `splitlm export-onnx` again")
        if precision not in onnx.precisions:
            raise SplitLMError(
                f"{edge_dir} has no {precision} ONNX export; run `splitlm export-onnx --edge "
                f"{edge_dir}{' --int8' if precision == 'int8' else ''}`"
            )
        self.precision, self.adapter = precision, onnx.adapter
        threads = threads or int(os.environ.get("SPLITLM_ONNX_THREADS", "0")) or torch.get_num_threads()
        kv = (self.cfg.num_kv_heads, self.cfg.head_dim)
        self.head = _Segment(graph_file(edge_dir, "head", precision), onnx.head_layers, kv, threads)
        self.tail = _Segment(graph_file(edge_dir, "tail", precision), onnx.tail_layers, kv, threads)
        log.info("edge %s: ONNX Runtime %s graphs (CPU)", edge_dir, precision)

    def embed_and_head(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        new_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """ids [1, T] -> head outputs [1, T, D] fp32."""
        t = ids.shape[-1]
        h = self.head.run({"ids": ids.reshape(1, t).cpu().long().numpy()}, positions, new_mask, cache, t)
        return torch.from_numpy(h)

    def tail_and_logits(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        new_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        """h [1, T, D] -> logits [1, T or len(rows), V]."""
        t = h.shape[1]
        rows = torch.arange(t) if rows is None else torch.as_tensor(rows, dtype=torch.long)
        feeds = {"hidden": h.float().cpu().contiguous().numpy(), "rows": rows.reshape(-1).numpy()}
        return torch.from_numpy(self.tail.run(feeds, positions, new_mask, cache, t))[None]

    def weight_bytes(self) -> int:
        return sum(seg.path.stat().st_size for seg in (self.head, self.tail))


def parse_onnx_device(spec) -> str | None:
    """`onnx` -> fp32, `onnx:int8` -> int8 (or `onnx:fp32`); None for any other device."""
    text = str(spec or "").strip().lower()
    kind, _, precision = text.partition(":")
    if kind != "onnx":
        return None
    precision = precision or "fp32"
    if precision not in PRECISIONS:
        raise SplitLMError(f"unknown device {text!r} (ONNX: onnx or onnx:int8)")
    return precision
