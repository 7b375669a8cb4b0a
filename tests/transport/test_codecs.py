"""Wire codecs: float casts and the per-row scaled int8 / fp8 (e4m3) codecs."""

import struct

import pytest
import torch

from splitlm.transport.codecs import WIRE_DTYPES, decode_tensor, encode_tensor, wire_nbytes
from splitlm.transport.errors import ErrorCode, ProtocolError


@pytest.mark.parametrize("codec,rel", [("fp32", 0), ("fp16", 1e-3), ("bf16", 8e-3), ("int8", 1e-2), ("fp8", 4e-2)])
def test_round_trip_error_is_bounded_per_row(codec, rel):
    torch.manual_seed(0)
    x = torch.randn(7, 96) * torch.logspace(-2, 3, 7)[:, None]  # rows of very different scales
    data = encode_tensor(x, codec)
    assert len(data) == wire_nbytes(codec, [7, 96])
    y = decode_tensor(data, codec, [7, 96], 10**6).float()
    err = (y - x).norm(dim=1) / x.norm(dim=1)  # per row: a row's scale does not hurt another's
    assert float(err.max()) <= rel


def test_scaled_layout_is_scales_then_codes():
    x = torch.tensor([[1.0, -0.5, 0.0], [0.0, 0.0, 0.0]])
    data = encode_tensor(x, "int8")
    scales = struct.unpack("<2f", data[:8])
    assert scales == pytest.approx((1 / 127, 1.0))
    assert list(data[8:]) == [127, (-64) & 0xFF, 0, 0, 0, 0]  # -0.5 * 127 = -63.5 rounds to even: -64
    assert torch.equal(decode_tensor(data, "int8", [2, 3], 10), torch.tensor([[1.0, -64 / 127, 0], [0, 0, 0]]))


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_scaled_codecs_reject_bad_input(codec):
    good = encode_tensor(torch.ones(2, 4), codec)
    with pytest.raises(ProtocolError) as e:
        decode_tensor(good[:-1], codec, [2, 4], 100)
    assert e.value.code == ErrorCode.BAD_FRAME
    for bad_scale in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ProtocolError):
            decode_tensor(struct.pack("<f", bad_scale) + good[4:], codec, [2, 4], 100)
    with pytest.raises(ProtocolError) as e:
        decode_tensor(good, codec, [2, 4], 7)
    assert e.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(OverflowError):
        encode_tensor(torch.tensor([[1.0, float("inf")]]), codec)


def test_empty_and_scalar_tensors():
    for codec in WIRE_DTYPES:
        assert decode_tensor(encode_tensor(torch.zeros(0, 5), codec), codec, [0, 5], 10).shape == (0, 5)
        assert float(decode_tensor(encode_tensor(torch.tensor(2.5), codec), codec, [], 10)) == 2.5


def test_fp8_nan_codes_decode_to_nan_so_the_cloud_rejects_them():
    data = struct.pack("<f", 1.0) + bytes([0x7F, 0x00])  # 0x7f is NaN in e4m3fn
    y = decode_tensor(data, "fp8", [2], 10)
    assert torch.isnan(y[0]) and y[1] == 0
