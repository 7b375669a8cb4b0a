import pytest
import torch

from splitlm.transport.codecs import decode_tensor, encode_tensor
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    HEADER_SIZE,
    Frame,
    MsgType,
    decode_frame,
    encode_frame,
    pack_mask,
    pack_tensors,
    unpack_mask,
    unpack_tensors,
)


def test_header_is_32_bytes_and_frames_round_trip():
    x = torch.randn(3, 8)
    specs, payload = pack_tensors({"hidden": x}, "fp32")
    frame = Frame(
        MsgType.FORWARD, session=0xDEADBEEF, seq=7, meta={"tensors": specs, "positions": [4, 5, 6]}, payload=payload
    )
    data = encode_frame(frame)
    assert HEADER_SIZE == 32 and data[:4] == b"SPLM"
    back = decode_frame(data)
    assert (back.type, back.session, back.seq, back.meta["positions"]) == (MsgType.FORWARD, 0xDEADBEEF, 7, [4, 5, 6])
    assert torch.equal(unpack_tensors(back, 10_000)["hidden"], x)
    assert len(payload) == 3 * 8 * 4  # raw bytes, no base64


@pytest.mark.parametrize("dtype,tol", [("fp32", 0.0), ("fp16", 1e-3), ("bf16", 1e-2)])
def test_codecs(dtype, tol):
    x = torch.randn(5, 16)
    raw = encode_tensor(x, dtype)
    assert len(raw) == x.numel() * (4 if dtype == "fp32" else 2)
    y = decode_tensor(raw, dtype, [5, 16], 1000).float()
    assert torch.allclose(x, y, atol=tol * 4, rtol=tol)


def test_mask_packs_to_bits():
    m = torch.rand(13, 13) > 0.5
    packed = pack_mask(m)
    assert len(packed) == (13 * 13 + 7) // 8
    assert torch.equal(unpack_mask(packed, 13), m)
    with pytest.raises(ProtocolError):
        unpack_mask(packed[:-1], 13)


@pytest.mark.parametrize(
    "data,code",
    [
        (b"", ErrorCode.BAD_FRAME),
        (b"XXXX" + bytes(28), ErrorCode.BAD_FRAME),
        ("text frame", ErrorCode.BAD_FRAME),
        (encode_frame(Frame(MsgType.HELLO))[: -0 or None] + b"extra", ErrorCode.BAD_FRAME),
        (b"SPLM\x09" + bytes(27), ErrorCode.VERSION_MISMATCH),
        (b"SPLM\x02\x63" + bytes(26), ErrorCode.BAD_FRAME),  # unknown type
        (b"SPLM\x02\x01\x80\x00" + bytes(24), ErrorCode.BAD_FRAME),  # unknown flag bit
    ],
)
def test_malformed_frames_raise(data, code):
    with pytest.raises(ProtocolError) as e:
        decode_frame(data)
    assert e.value.code == code


def test_tensor_descriptions_are_checked():
    specs, payload = pack_tensors({"hidden": torch.zeros(2, 4)}, "fp16")
    for bad in (
        {**specs[0], "offset": 10},
        {**specs[0], "shape": [4, 4]},
        {**specs[0], "dtype": "int4"},
        {**specs[0], "shape": [-1, 4]},
        {"name": "hidden"},
    ):
        with pytest.raises(ProtocolError):
            unpack_tensors(Frame(MsgType.FORWARD, meta={"tensors": [bad]}, payload=payload), 1000)
    with pytest.raises(ProtocolError) as e:
        unpack_tensors(Frame(MsgType.FORWARD, meta={"tensors": specs}, payload=payload), 4)
    assert e.value.code == ErrorCode.TOO_LARGE


def test_fp16_overflow_is_refused_not_sent_as_infinity():
    from splitlm.transport.codecs import encode_tensor

    with pytest.raises(OverflowError, match="bf16"):
        encode_tensor(torch.tensor([1.0, 1e6]), "fp16")
    assert len(encode_tensor(torch.tensor([1.0, 1e6]), "bf16")) == 4
