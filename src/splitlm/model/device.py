"""Where a model runs and in which precision: `--device` and `--dtype`, resolved once at load time.

    device  auto (CUDA where present, else CPU) | cpu | cuda | cuda:N | mps
    dtype   auto (bf16 on CUDA, fp32 elsewhere) | fp32 | bf16 | fp16

The run-time dtype is independent of the dtype a shard is stored in, and each side (edge, cloud)
chooses its own. The wire, the transport and the decoding layer work on host tensors: a session
moves what it receives to its device once (`to_device`, through pinned memory on CUDA) and
hands host tensors back once per step (`to_host`).
"""

from __future__ import annotations

import argparse

import torch

from splitlm import SplitLMError

DEVICE_CHOICES = "auto|cpu|cuda|cuda:N|mps"
DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """The torch device for `spec`; a clear error when it is unknown or not present here."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise SplitLMError("--device mps: Apple's Metal backend is not available on this machine")
        return torch.device("mps")
    kind, colon, index = spec.partition(":")
    if kind == "onnx":
        raise SplitLMError(
            f"--device {spec} runs only the edge's layers (generate, chat, serve-edge, "
            "bench --edge-profiles); the cloud's run on cpu or cuda"
        )
    if kind != "cuda" or (colon and not index.isdigit()):
        raise SplitLMError(f"unknown device {spec!r} (choose from {DEVICE_CHOICES})")
    if not torch.cuda.is_available():
        raise SplitLMError(f"--device {spec}: no CUDA device is available on this machine (use cpu or auto)")
    if index and int(index) >= torch.cuda.device_count():
        raise SplitLMError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", int(index) if index else torch.cuda.current_device())


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute dtype for `spec` on `device` (`auto`: bf16 on CUDA, fp32 elsewhere)."""
    if isinstance(spec, torch.dtype):
        if spec not in DTYPE_NAMES:
            raise SplitLMError(f"unsupported compute dtype {spec}")
        return spec
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec not in DTYPES:
        raise SplitLMError(f"unknown dtype {spec!r} (choose from {', '.join(DTYPE_CHOICES)})")
    return DTYPES[spec]


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def describe(device: torch.device, dtype: torch.dtype) -> str:
    """E.g. `cuda:0 (NVIDIA H200) bf16`, for logs and /healthz."""
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    return f"{device}{name} {dtype_name(dtype)}"


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor onto `device` (cast to `dtype` there), once; pinned staging on CUDA."""
    if t.device == device:
        return t if dtype is None else t.to(dtype)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
        return t.to(device, non_blocking=True) if dtype is None else t.to(device, non_blocking=True).to(dtype)
    return t.to(device) if dtype is None else t.to(device, dtype)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A result back to host memory (one copy per step; a no-op on CPU)."""
    return t if t.device.type == "cpu" else t.cpu()


def add_device_arguments(
    p: argparse.ArgumentParser, side: str = "", what: str = "the model's layers", onnx: bool = False
) -> None:
    """--device and --dtype (with side="cloud": --cloud-device and --cloud-dtype, default as the former;
    `onnx`: the edge's --device also takes onnx and onnx:int8, `splitlm.edge.onnx_runtime`)."""
    flag = f"--{side}-" if side else "--"
    same = " (default: as --device)", " (default: as --dtype)"
    auto = " (default auto: CUDA where present, else the CPU)", " (default auto: bf16 on CUDA, fp32 elsewhere)"
    notes = same if side else auto
    extra = "; onnx or onnx:int8: ONNX Runtime on the CPU, graphs from `splitlm export-onnx`" if onnx else ""
    p.add_argument(
        f"{flag}device",
        default=None if side else "auto",
        metavar=DEVICE_CHOICES + ("|onnx|onnx:int8" if onnx else ""),
        help=f"where {what} run{notes[0]}{extra}",
    )
    p.add_argument(
        f"{flag}dtype",
        default=None if side else "auto",
        choices=DTYPE_CHOICES,
        help=f"compute precision of {what}, whatever dtype the shard is stored in{notes[1]}",
    )
