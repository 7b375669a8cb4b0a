"""Tensor codecs: how activations are written as raw little-endian bytes on the wire.

Float codecs (fp32, fp16, bf16) are the values themselves. Scaled codecs (int8, fp8 = e4m3) are
one fp32 scale per row (the last dimension is the row), then one byte per element:
value = code × scale. Scaled codecs decode to fp32.
"""

from __future__ import annotations

import math

import torch

from splitlm.transport.errors import ErrorCode, ProtocolError

FLOAT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SCALED_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
WIRE_DTYPES = [*FLOAT_DTYPES, *SCALED_DTYPES]
CODE_MAX = {"int8": 127.0, "fp8": 448.0}  # largest code magnitude: the row's max |value| maps to it


def check_wire_dtype(name: str) -> str:
    if name not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {name!r} (choose from {', '.join(WIRE_DTYPES)})")
    return name


def rows_cols(shape: list[int] | torch.Size) -> tuple[int, int]:
    """A tensor as rows × columns for per-row scales: the last dimension is the row (a scalar is 1 × 1)."""
    cols = shape[-1] if len(shape) else 1
    return (math.prod(shape[:-1]) if len(shape) else 1), cols


def wire_nbytes(wire_dtype: str, shape: list[int] | torch.Size) -> int:
    n = math.prod(shape)
    if wire_dtype in FLOAT_DTYPES:
        return n * torch.empty((), dtype=FLOAT_DTYPES[wire_dtype]).element_size()
    rows, _ = rows_cols(shape)
    return 4 * rows + n


def quantize(t: torch.Tensor, wire_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scaled codes: (scales [rows] fp32, codes [rows, cols] int8 or float8_e4m3fn)."""
    rows, cols = rows_cols(t.shape)
    x = t.detach().float().reshape(rows, cols)
    if not bool(torch.isfinite(x).all()):
        raise OverflowError(f"cannot quantise non-finite activations to {wire_dtype}")
    top = CODE_MAX[wire_dtype]
    amax = x.abs().amax(dim=1) if cols else torch.zeros(rows)
    scales = torch.where(amax > 0, amax / top, torch.ones_like(amax))  # [rows]
    y = (x / scales[:, None]).clamp(-top, top)
    codes = y.round().to(torch.int8) if wire_dtype == "int8" else y.to(torch.float8_e4m3fn)
    return scales, codes


def dequantize(scales: torch.Tensor, codes: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return (codes.float() * scales[:, None]).reshape(shape)


def encode_tensor(t: torch.Tensor, wire_dtype: str) -> bytes:
    """Encode to the wire dtype and return the raw bytes (row-major, little-endian).

    Raises OverflowError when finite values become infinite in the cast (fp16's range is ±65504)."""
    if wire_dtype in SCALED_DTYPES:
        scales, codes = quantize(t, wire_dtype)
        return scales.numpy().astype("<f4").tobytes() + codes.reshape(-1).view(torch.uint8).numpy().tobytes()
    cast = t.detach().to(FLOAT_DTYPES[wire_dtype])
    if wire_dtype == "fp16" and not bool(torch.isfinite(cast).all()) and bool(torch.isfinite(t).all()):
        raise OverflowError(
            f"activations up to {float(t.abs().max()):.3g} exceed the fp16 wire range; use --wire-dtype bf16 or fp32"
        )
    t = cast.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def decode_tensor(data: bytes | memoryview, wire_dtype: str, shape: list[int], max_elements: int) -> torch.Tensor:
    """Inverse of `encode_tensor`; validates dtype, shape and length before touching the bytes."""
    if not isinstance(wire_dtype, str) or wire_dtype not in WIRE_DTYPES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"unknown tensor dtype {wire_dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"bad tensor shape {shape!r}")
    n = math.prod(shape)
    if n > max_elements:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"tensor of {n} elements exceeds the limit of {max_elements}")
    need = wire_nbytes(wire_dtype, shape)
    if len(data) != need:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"tensor {shape} {wire_dtype} needs {need} bytes, got {len(data)}")
    if wire_dtype in SCALED_DTYPES:
        rows, cols = rows_cols(shape)
        raw = bytearray(data)
        scales = torch.frombuffer(raw, dtype=torch.float32, count=rows) if rows else torch.zeros(0)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise ProtocolError(ErrorCode.BAD_FRAME, f"{wire_dtype} tensor has bad scales")
        codes = torch.frombuffer(raw, dtype=torch.uint8, offset=4 * rows) if n else torch.zeros(0, dtype=torch.uint8)
        codes = codes.view(SCALED_DTYPES[wire_dtype]).reshape(rows, cols)
        return dequantize(scales, codes, shape)
    dtype = FLOAT_DTYPES[wire_dtype]
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
