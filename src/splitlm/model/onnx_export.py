"""The edge shard as two ONNX graphs, for ONNX Runtime on the CPU (`--device onnx`).

    head.onnx  ids [1, T], positions [T], mask [T, S+T], key_positions [S+T], past K/V of each head layer
               -> hidden [1, T, D] (fp32, the residual stream), the T new K/V entries of each layer
    tail.onnx  hidden [1, T, D], positions, mask, key_positions, rows [R], past K/V of each tail layer
               -> logits [R, V] (the rows asked for), the T new K/V entries of each layer

The KV cache stays outside the graphs (`splitlm.model.kv_cache.KVCache`, kept in torch by the edge):
each call takes the S entries so far, [1, H_kv, S, hd] per layer, and returns only the T new ones,
so keep/crop for speculative trees are the cache's own operations. `mask` is the full visibility
of the new tokens, [T, S+T] bool (the tree mask in its last T columns); `key_positions` the
position of every key (sliding-window layers hide keys too far back).

The graphs run the model's own modules (`splitlm.model.llama.Block`), traced by the TorchScript
exporter with dynamic T, S and R. `--int8` adds `*.int8.onnx`: the same graphs with the weights of the
matrix products (per output channel) and the embedding table quantised to int8 by ONNX Runtime's
dynamic quantisation (activations quantised per call, per tensor).
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from splitlm import SplitLMError
from splitlm.model import llama
from splitlm.model.llama import LayerStack, Part, embed, rope_cos_sin, softcap

log = logging.getLogger(__name__)

ONNX_DIR = "onnx"  # inside the edge shard directory
OPSET = 17
SEGMENTS = ("head", "tail")


@dataclass
class OnnxManifest:
    """`onnx/onnx.json`: what was exported, for which shard."""

    fingerprint: str  # the edge shard's (the graphs hold its weights)
    head_layers: int
    tail_layers: int
    precisions: list[str]  # "fp32", and "int8" with --int8
    opset: int = OPSET
    adapter: str = ""  # the LoRA adapter merged into the graphs' weights (`--edge-adapter`), if any

    @staticmethod
    def path(edge_dir: str | Path) -> Path:
        return Path(edge_dir) / ONNX_DIR / "onnx.json"

    @classmethod
    def read(cls, edge_dir: str | Path) -> OnnxManifest:
        path = cls.path(edge_dir)
        if not path.is_file():
            raise SplitLMError(f"{edge_dir} has no ONNX export; run `splitlm export-onnx --edge {edge_dir}` first")
        return cls(**json.loads(path.read_text()))


def graph_file(edge_dir: str | Path, segment: str, precision: str) -> Path:
    return Path(edge_dir) / ONNX_DIR / (f"{segment}.onnx" if precision == "fp32" else f"{segment}.{precision}.onnx")


class _ExportCache:
    """Stands in for a KVCache while tracing: past entries in, new entries recorded."""

    def __init__(self, past: list[torch.Tensor]):
        self.past = past  # k0, v0, k1, v1, ...: [1, Hkv, S, hd]
        self.new: list[torch.Tensor] = []

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.new += [k, v]  # [1, Hkv, T, hd]
        return torch.cat([self.past[2 * layer], k], dim=2), torch.cat([self.past[2 * layer + 1], v], dim=2)


def run_layers(
    stack: LayerStack,
    x: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    key_positions: torch.Tensor,
    past: list[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stack's layers on x [1, T, D] with the past K/V given as tensors; (output, new K/V)."""
    cache = _ExportCache(past)
    full = mask[None, None]  # [1, 1, T, S+T]
    masks = {None: full}
    for w in set(stack.windows) - {None}:
        masks[w] = full & (positions[:, None] - key_positions[None, :] < w)
    dtype = stack.layers[0].input_layernorm.weight.dtype
    rope = {False: rope_cos_sin(stack.inv_freq, positions[None], dtype)}
    if any(stack.local_rope):
        rope[True] = rope_cos_sin(stack.inv_freq_local, positions[None], dtype)
    parts = [Part(x.shape[1], rope, masks, cache)]
    x = x.float()
    for i, layer in enumerate(stack.layers):
        x = layer(x, parts, i, stack.windows[i], stack.local_rope[i])
    return x, cache.new


class HeadGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.cfg, self.embed_tokens, self.stack = model.cfg, model.embed_tokens, model.head

    def forward(self, ids, positions, mask, key_positions, *past):
        x = embed(self.embed_tokens, ids, self.cfg)  # [1, T, D]
        h, new = run_layers(self.stack, x, positions, mask, key_positions, list(past))
        return (h, *new)


class TailGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.cfg, self.stack, self.norm = model.cfg, model.tail, model.norm
        self.weight = model.head_weight  # [V, D]

    def forward(self, hidden, positions, mask, key_positions, rows, *past):
        if len(self.stack.layers):
            h, new = run_layers(self.stack, hidden, positions, mask, key_positions, list(past))
        else:
            h, new = hidden.float(), []
        h = h[0].index_select(0, rows)  # [R, D]: the LM head only where logits are needed
        logits = softcap(F.linear(self.norm(h), self.weight), self.cfg.final_logit_softcapping)  # [R, V]
        return (logits.float(), *new)


def _kv_names(n_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}_{kind}_{i}" for i in range(n_layers) for kind in ("k", "v")]


def _export(graph: nn.Module, args: tuple, inputs: list[str], outputs: list[str], path: Path, n_layers: int) -> None:
    dyn = {
        "ids": {1: "T"},
        "hidden": {1: "T"},
        "positions": {0: "T"},
        "mask": {0: "T", 1: "ST"},
        "key_positions": {0: "ST"},
        "rows": {0: "R"},
        "logits": {0: "R"},
        "h": {1: "T"},
    }
    dyn.update({n: {2: "S"} for n in _kv_names(n_layers, "past")})
    dyn.update({n: {2: "T"} for n in _kv_names(n_layers, "new")})
    dyn = {k: v for k, v in dyn.items() if k in inputs or k in outputs}
    gqa, llama.SDPA_GQA = llama.SDPA_GQA, False  # grouped heads as repeated K/V: plain ONNX attention
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's notice of its successor
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            torch.onnx.export(
                graph,
                args,
                str(path),
                input_names=inputs,
                output_names=outputs,
                dynamic_axes=dyn,
                opset_version=OPSET,
                dynamo=False,
                do_constant_folding=True,
            )
    finally:
        llama.SDPA_GQA = gqa


def cpu_has_vnni() -> bool:
    """Whether this CPU has VNNI (AVX-512 VNNI or AVX-VNNI), whose int8 products ONNX Runtime's u8s8
    kernels use; without it they go through 16-bit sums that saturate at full 8-bit range."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True  # not Linux: keep full range, as measured
    return "avx512_vnni" in flags or "avx_vnni" in flags


def export_edge_onnx(model, edge_dir: str | Path, int8: bool = False, adapter: str = "") -> OnnxManifest:
    """Write `edge_dir/onnx/` for `model` (an fp32 `EdgeModel` of that shard): head.onnx, tail.onnx,
    with `int8` also head.int8.onnx and tail.int8.onnx, and onnx.json."""
    if model.split_head:
        raise SplitLMError("export-onnx supports the tail-local topology only (a split-head edge has no tail)")
    if next(model.parameters()).dtype != torch.float32:
        raise SplitLMError("export-onnx needs the edge in fp32")
    out = Path(edge_dir) / ONNX_DIR
    out.mkdir(parents=True, exist_ok=True)
    cfg, nh, nt = model.cfg, len(model.head.layers), len(model.tail.layers)
    t, s = 3, 2  # example shapes for tracing (dynamic in the graphs)
    kv = [torch.zeros(1, cfg.num_kv_heads, s, cfg.head_dim) for _ in range(2 * max(nh, nt))]
    pos = torch.arange(s, s + t)
    mask = torch.ones(t, s + t, dtype=torch.bool)
    keys = torch.arange(s + t)
    with torch.no_grad():
        _export(
            HeadGraph(model).eval(),
            (torch.zeros(1, t, dtype=torch.long), pos, mask, keys, *kv[: 2 * nh]),
            ["ids", "positions", "mask", "key_positions", *_kv_names(nh, "past")],
            ["hidden", *_kv_names(nh, "new")],
            graph_file(edge_dir, "head", "fp32"),
            nh,
        )
        _export(
            TailGraph(model).eval(),
            (torch.zeros(1, t, cfg.hidden_size), pos, mask, keys, torch.arange(t), *kv[: 2 * nt]),
            ["hidden", "positions", "mask", "key_positions", "rows", *_kv_names(nt, "past")],
            ["logits", *_kv_names(nt, "new")],
            graph_file(edge_dir, "tail", "fp32"),
            nt,
        )
    precisions = ["fp32"]
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        root, level = logging.getLogger(), logging.getLogger().level
        root.setLevel(logging.ERROR)  # (its advice to pre-process image models first)
        try:
            for seg in SEGMENTS:  # int8 weights per output channel; activations quantised per call (per tensor)
                quantize_dynamic(
                    graph_file(edge_dir, seg, "fp32"),
                    graph_file(edge_dir, seg, "int8"),
                    weight_type=QuantType.QInt8,
                    per_channel=True,
                    reduce_range=not cpu_has_vnni(),  # 7-bit weights where 8-bit sums would saturate
                    op_types_to_quantize=["MatMul", "Gather"],
                )
        finally:
            root.setLevel(level)
        precisions.append("int8")
    else:  # a stale int8 export would not match these weights
        for seg in SEGMENTS:
            graph_file(edge_dir, seg, "int8").unlink(missing_ok=True)
    manifest = OnnxManifest(model.manifest.fingerprint, nh, nt, precisions, adapter=adapter)
    OnnxManifest.path(edge_dir).write_text(json.dumps(asdict(manifest), indent=2))
    return manifest
