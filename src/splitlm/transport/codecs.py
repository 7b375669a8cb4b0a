"""Tensor codecs: how activations are written as raw little-endian bytes on the wire."""

from __future__ import annotations

import math

import torch

from splitlm.transport.errors import ErrorCode, ProtocolError

WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def check_wire_dtype(name: str) -> str:
    if name not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {name!r} (choose from {', '.join(WIRE_DTYPES)})")
    return name


def encode_tensor(t: torch.Tensor, wire_dtype: str) -> bytes:
    """Cast to the wire dtype and return the raw bytes (row-major, little-endian).

    Raises OverflowError when finite values become infinite in the cast (fp16's range is ±65504)."""
    cast = t.detach().to(WIRE_DTYPES[wire_dtype])
    if wire_dtype == "fp16" and not bool(torch.isfinite(cast).all()) and bool(torch.isfinite(t).all()):
        raise OverflowError(f"activations up to {float(t.abs().max()):.3g} exceed the fp16 wire range; "
                            "use --wire-dtype bf16 or fp32")
    t = cast.contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def decode_tensor(data: bytes | memoryview, wire_dtype: str, shape: list[int], max_elements: int) -> torch.Tensor:
    """Inverse of `encode_tensor`; validates dtype, shape and length before touching the bytes."""
    if not isinstance(wire_dtype, str) or wire_dtype not in WIRE_DTYPES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"unknown tensor dtype {wire_dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"bad tensor shape {shape!r}")
    n = math.prod(shape)
    if n > max_elements:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"tensor of {n} elements exceeds the limit of {max_elements}")
    dtype = WIRE_DTYPES[wire_dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) != n * itemsize:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"tensor {shape} {wire_dtype} needs {n * itemsize} bytes, got {len(data)}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
