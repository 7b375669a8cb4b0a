"""`Linear`: nn.Linear that, on a CPU in fp32 or bf16, multiplies a few rows at a time with
oneDNN's blocked copy of its weight.

A speculative verification pass multiplies 4–32 rows by each weight. MKL's plain sgemm is poor
at that size on one thread (measured here: 11 rows cost 2.5× one row for a 1536×576 weight read
from memory), while oneDNN's kernel on a weight reordered once into its blocked layout costs about
1.2× (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing uses). More than 64
rows (prefill) stay on the plain product, which is as fast or faster there, and on Intel CPUs fewer
than 4 rows too (`MIN_ROWS`; elsewhere MKL's generic path is slower at every size). The result is the same fp32
product, summed in
another order: last-bit differences, like any change of matrix shape. In bf16 the blocked copy is
faster at every row count (an 8192×576 weight, 6 rows: 2.3 -> 1.4 ms from memory); layers that set
`bf16_blocked` (the draft head's) use it there, a model's bf16 layers do not (their second copy
would double a bf16 cloud's memory).

`project(x, *linears)` multiplies several layers that read the same input (q, k and v; gate and
up) as one blocked weight, one stream through memory instead of several. Together, for the bundled
model's 26 cloud layers on one thread (one run, interleaved): 11 rows 103 -> 79 ms, 8 rows
92 -> 75, 4 rows 80 -> 72, 1 row 49 either way.

The blocked copy is made on first use and remade when the weight changes (an adapter merged in);
it is used only without autograd and costs one more copy of the weight's bytes. Off with
`SPLITLM_PACKED_LINEAR=0`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _intel_cpu() -> bool:
    """Whether this CPU is Intel's: MKL's plain sgemm takes its fast paths only there."""
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line for line in f if line.startswith("vendor_id")), "")  # the first CPU's is every CPU's
        return "GenuineIntel" in vendor
    except OSError:
        return True  # not Linux: keep the rule measured on Intel


# Below MIN_ROWS the plain product is used. On Intel it is faster there (3 rows: 1.17x slower
# blocked, 4 rows: 0.9x; 1 row equal); on other CPUs MKL's generic path is slow at every row count
# (AMD EPYC, the 26 cloud layers, one thread: 1 row 38.5 -> 29-30 ms blocked, 2 rows 53.6 -> 32-35).
MIN_ROWS = 4 if _intel_cpu() else 1
MAX_ROWS = 64  # fp32 prefill-sized products: the plain sgemm is as fast or faster (384 rows: 4 % faster)
PACK_FOR_ROWS = 32  # the row count oneDNN tunes its layout for; 8–64 measured within noise
MIN_WEIGHT_ELEMENTS = (
    1 << 18
)  # 1 MB in fp32; smaller weights (tiny test models) stay plain: 64x64 costs 52 us blocked, 16 plain


def _available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


ENABLED = os.environ.get("SPLITLM_PACKED_LINEAR", "1") != "0" and _available()


# torch's private names, in one place: torch has no public API for oneDNN's blocked linear weight
# (what inductor's CPU freezing calls) nor for a tensor's version counter.


def reorder_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """oneDNN's blocked copy of `weight` [out, in], its layout tuned for products of `rows` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)  # noqa: SLF001  (no public API for oneDNN's blocked weight)


def blocked_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W.T (+ bias) -> [..., out], W given as its blocked copy (`reorder_weight`)."""
    return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")  # noqa: SLF001  (no public API for oneDNN's blocked linear)


def version(w: torch.Tensor) -> int:
    """`w`'s version counter (bumped by each in-place change); -1 for inference tensors, which keep none."""
    return -1 if w.is_inference() else w._version  # noqa: SLF001  (torch has no public API for the version counter)


@functools.cache
def bf16_blocked_supported() -> bool:
    """Whether oneDNN makes blocked bf16 weights on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    an AVX2-only CPU refuses): a one-off trial on a tiny weight."""
    try:
        reorder_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
    except RuntimeError:
        return False
    return True


def _blocked(
    x: torch.Tensor, weights: list[torch.Tensor], bf16: bool, min_rows: int = MIN_ROWS, max_rows: float = MAX_ROWS
) -> bool:
    """Whether this product goes through the blocked copy (`bf16`: the layers allow it in bf16; in fp32 only
    products of `min_rows` to `max_rows` rows do)."""
    if not ENABLED or x.shape[-1] == 0:
        return False
    if x.dtype == torch.float32:
        rows = x.numel() // x.shape[-1]
        if not min_rows <= rows <= max_rows:
            return False
    elif not (bf16 and x.dtype == torch.bfloat16 and bf16_blocked_supported()):
        return False
    if sum(w.numel() for w in weights) < MIN_WEIGHT_ELEMENTS:
        return False  # small enough to stay in cache: oneDNN's fixed cost per call (about 20 us) outweighs the gain
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling():
        return False  # exporters and compilers get the plain product they know
    return all(w.device.type == "cpu" and w.dtype == x.dtype for w in weights) and not (
        torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))
    )


def _same(key: tuple, weights: list[torch.Tensor]) -> bool:
    """Whether the blocked copy made for `key` still holds `weights`. The key keeps each weight and its
        storage alive, so no later tensor can take its address: a weight replaced (`load_state_dict`,
        `.to()`, `.data = ...`) or changed in place (which bumps its version) is always seen. A change
        made through `.data` in place bumps no version and is not: call `forget_blocked` after one (as
    merging a peft adapter does)."""
    return len(key) == len(weights) and all(
        k[0] is w and k[2] == w.data_ptr() and k[3] == version(w) for k, w in zip(key, weights, strict=True)
    )


def frozen_product(weight: torch.Tensor, rows: int = 16) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [..., in] -> x @ weight.T for a weight that never changes (the screened LM head's bf16 copy):
    through its blocked copy alone on a CPU with oneDNN, so the plain copy need not be kept. bf16,
    a 49152x576 weight read from cache, 1-20 rows: 12 -> 4 ms tuned for 16 rows (32 and 64 were slower
    from memory)."""
    dtype = weight.dtype
    supported = dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_blocked_supported())
    if ENABLED and weight.device.type == "cpu" and supported:
        blocked = reorder_weight(weight.detach(), rows)  # the only copy kept
        return lambda x: blocked_linear(x.to(dtype), blocked, None)
    return lambda x: F.linear(x.to(dtype), weight)


class KeptWeightProduct:
    """x [N, in] -> x @ weight.T for a weight that never changes and whose plain copy stays in use
    elsewhere (an LM head tied to the embedding table): one row through the plain product, two or more
    through oneDNN's blocked copy, made on first use, so a decoder that never sends a tree never pays
    its memory (one more copy of the weight's bytes). A verification pass's head, one thread, AMD EPYC
    (best of 3): Qwen2.5-Coder-1.5B's 151,936 x 1,536 at 1 row 55 -> 62 ms (so plain), 2 rows
    115 -> 67, 4 rows 192 -> 82, 8 rows 197 -> 103, 64 rows 572 -> 461; the bundled model's
    49,152 x 576 at 2 rows 23 -> 10 ms, 8 rows 25 -> 15. fp32 only (an AVX2 CPU makes no blocked bf16)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [out, in]
        self.blocked: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        w = self.weight
        if x.dim() != 2 or not _blocked(x, [w], bf16=False, min_rows=2, max_rows=math.inf):
            return F.linear(x, w)
        if self.blocked is None:
            self.blocked = reorder_weight(w.detach(), PACK_FOR_ROWS)
        return blocked_linear(x, self.blocked, None)


def forget_blocked(module: nn.Module) -> None:
    """Drop the blocked copies in `module` (after its weights changed through `.data`)."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = None


class Linear(nn.Linear):
    bf16_blocked = False  # a model's bf16 layers stay plain: a second copy of a large model costs too much memory
    # (the weights it was made from, `_same`'s key; blocked copy; bias): made by `project`, kept on the first layer
    packed: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state.pop("packed", None)  # a copy or a pickle remakes it (oneDNN's blocked tensor cannot be copied)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return project(x, self)[0]


def project(x: torch.Tensor, *linears: nn.Linear) -> list[torch.Tensor]:
    """x [..., in] through each of `linears` (all reading `in` features) -> one output each."""
    if not all(type(m) is Linear for m in linears):  # e.g. a layer wrapped by an adapter
        return [m(x) for m in linears]
    weights = [m.weight for m in linears]
    if not _blocked(x, weights, all(m.bf16_blocked for m in linears)):
        return [F.linear(x, m.weight, m.bias) for m in linears]
    first = linears[0]
    if first.packed is None or not _same(first.packed[0], weights):
        stacked = weights[0] if len(weights) == 1 else torch.cat(weights)  # [sum out, in]
        biases = [m.bias for m in linears]
        bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b if b is not None else stacked.new_zeros(m.out_features)
                    for b, m in zip(biases, linears, strict=True)
                ]
            )
        )
        key = tuple((w, w.untyped_storage(), w.data_ptr(), version(w)) for w in weights)
        first.packed = (key, reorder_weight(stacked.detach(), PACK_FOR_ROWS), None if bias is None else bias.detach())
    y = blocked_linear(x, first.packed[1], first.packed[2])  # [..., sum out]
    return list(y.split([m.out_features for m in linears], dim=-1)) if len(linears) > 1 else [y]
