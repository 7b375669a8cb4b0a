"""The typed messages: each request and reply survives to_frame / from_frame, and malformed fields get §7's codes."""

import ast
from pathlib import Path

import pytest
import torch

from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import Frame, MsgType, decode_frame, encode_frame
from splitlm.transport.messages import (
    REPLY_TYPE,
    Close,
    Closed,
    Control,
    ErrorReply,
    Forward,
    Open,
    Opened,
    PolicyChange,
    PolicyOk,
    Result,
    answering,
    reply_ref,
)
from splitlm.transport.policy import CachePolicy

SRC = Path(__file__).resolve().parents[2] / "src" / "splitlm"


def wire(frame: Frame) -> Frame:
    """Through the byte encoding and back (plaintext: the encryption does not touch metadata or payload)."""
    return decode_frame(encode_frame(frame))


def test_open_and_opened_round_trip():
    req = Open("int8", CachePolicy("window", 16), b"\xff")
    assert Open.from_frame(wire(req.to_frame())) == req
    assert Open.from_frame(Frame(MsgType.OPEN)) == Open()  # the defaults: fp16, session
    rep = Opened(7, "fp16", CachePolicy("sealed"), "split-head", 300)
    assert Opened.from_frame(wire(rep.to_frame())) == rep


@pytest.mark.parametrize(
    "meta", [{"wire_dtype": "fp64"}, {"wire_dtype": 3}, {"cache_policy": "window:0"}, {"cache_policy": "forever"}]
)
def test_open_rejects_bad_fields(meta):
    with pytest.raises(ProtocolError) as e:
        Open.from_frame(Frame(MsgType.OPEN, meta=meta))
    assert e.value.code == ErrorCode.BAD_REQUEST


def test_forward_round_trip_keeps_every_field():
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    req = Forward(
        torch.randn(5, 8),
        torch.tensor([3, 4, 5, 6, 6]),
        mask,
        keep=[0, 2],
        crop=9,
        context=2,
        control=Control(cache=True, window=64, dtype="int8", split=2, key=b"k" * 32),
        rows=[2, 0],
    )
    got = Forward.from_frame(wire(req.to_frame(11, "fp32")), max_elements=1000)
    assert torch.equal(got.hidden, req.hidden) and torch.equal(got.positions, req.positions)
    assert torch.equal(got.mask, mask) and got.new_tokens == 3
    assert (got.keep, got.crop, got.context, got.control, got.rows) == ([0, 2], 9, 2, req.control, [2, 0])
    plain = Forward.from_frame(wire(Forward(torch.randn(2, 8), torch.tensor([0, 1])).to_frame(1, "fp16")), 100)
    assert (plain.mask, plain.keep, plain.crop, plain.context, plain.control, plain.rows) == (
        None,
        None,
        None,
        0,
        Control(),
        None,
    )


def bad_forward(**meta) -> Frame:
    frame = Forward(torch.randn(2, 8), torch.tensor([0, 1])).to_frame(1, "fp32")
    frame.meta.update(meta)
    return frame


@pytest.mark.parametrize(
    "meta,code",
    [
        ({"tensors": "x"}, ErrorCode.BAD_FRAME),
        ({"tensors": []}, ErrorCode.BAD_REQUEST),  # no hidden
        ({"positions": [0.5, 1]}, ErrorCode.BAD_REQUEST),
        ({"keep": [True]}, ErrorCode.BAD_REQUEST),
        ({"crop": "3"}, ErrorCode.BAD_REQUEST),
        ({"context": 2}, ErrorCode.BAD_REQUEST),
        ({"control": {"cache": "yes"}}, ErrorCode.BAD_REQUEST),
        ({"control": {"dtype": "fp64"}}, ErrorCode.BAD_REQUEST),
        ({"mask": b"\x00\x00"}, ErrorCode.BAD_REQUEST),
        ({"rows": "all"}, ErrorCode.BAD_REQUEST),
    ],
)
def test_forward_rejects_malformed_fields(meta, code):
    with pytest.raises(ProtocolError) as e:
        Forward.from_frame(bad_forward(**meta), max_elements=1000)
    assert e.value.code == code


def test_forward_too_many_elements_is_too_large():
    with pytest.raises(ProtocolError) as e:
        Forward.from_frame(bad_forward(), max_elements=8)
    assert e.value.code == ErrorCode.TOO_LARGE


def test_result_policy_and_close_round_trip():
    res = Result(5, torch.randn(2, 8), cache_len=12, compute_s=0.25, queue_s=0.125)
    got = Result.from_frame(wire(res.to_frame("fp32")), 100)
    assert (got.session, got.cache_len, got.compute_s, got.queue_s) == (5, 12, 0.25, 0.125)
    assert torch.equal(got.hidden, res.hidden) and got.logits is None
    change = PolicyChange(CachePolicy("none"), revoke=True, key=b"k" * 32)
    assert PolicyChange.from_frame(wire(change.to_frame(3))) == change
    assert PolicyChange.from_frame(wire(PolicyChange().to_frame(3))) == PolicyChange()
    ok = PolicyOk(3, CachePolicy("window", 4), 4)
    assert PolicyOk.from_frame(wire(ok.to_frame())) == ok
    assert wire(Close().to_frame(9)).type == MsgType.CLOSE and wire(Closed(9).to_frame()).session == 9
    with pytest.raises(ProtocolError):
        PolicyChange.from_frame(Frame(MsgType.POLICY, 3, meta={"revoke": 1}))


def test_one_table_names_each_requests_reply():
    assert REPLY_TYPE == {
        MsgType.HELLO: MsgType.HELLO_OK,
        MsgType.OPEN: MsgType.OPENED,
        MsgType.FORWARD: MsgType.RESULT,
        MsgType.POLICY: MsgType.POLICY_OK,
        MsgType.CLOSE: MsgType.CLOSED,
    }
    assert Closed.from_frame(wire(Closed(9).to_frame())) == Closed(9)
    with pytest.raises(ProtocolError):
        Closed.from_frame(Frame(MsgType.OPENED, 9))


def test_the_control_tuple_always_travels_through_to_meta():
    """Defaults stay off the wire; the receiving client's timings never go on it."""
    frame = Forward(torch.randn(1, 8), torch.tensor([0]), control=Control(cache=True, dtype="fp16")).to_frame(1, "fp32")
    assert frame.meta["control"] == {"dtype": "fp16"}
    assert "control" not in Forward(torch.randn(1, 8), torch.tensor([0])).to_frame(1, "fp32").meta
    res = Result(5, torch.randn(1, 8), cache_len=1, round_trip_s=0.5, wait_s=0.25)
    assert set(res.to_frame("fp32").meta) == {"tensors", "compute_s", "queue_s", "cache_len"}
    got = Result.from_frame(wire(res.to_frame("fp32")), 100)
    assert (got.round_trip_s, got.wait_s) == (0.0, 0.0)


def test_a_message_refuses_another_type():
    with pytest.raises(ProtocolError):
        Forward.from_frame(Frame(MsgType.OPEN), 10)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize(
    "package,forbidden",
    [
        ("edge", "splitlm.cloud"),
        ("cloud", "splitlm.edge"),
        ("transport", "splitlm.cloud"),
        ("transport", "splitlm.edge"),
        ("model", "splitlm."),
    ],
)
def test_layering(package, forbidden):
    """The edge and the cloud share only `model` and `transport`; `model` imports nothing of ours."""
    for path in (SRC / package).glob("*.py"):
        bad = {
            m
            for m in imports_of(path)
            if m.startswith(forbidden) and not (package == "model" and m.startswith("splitlm.model"))
        }
        if package == "model":
            bad -= {"splitlm", "splitlm.progress"}  # SplitLMError lives in the package root; the bars are a leaf
        assert not bad, f"{path.name} imports {bad}"


def test_server_info_keeps_the_documented_order_and_reads_partial_limits():
    from splitlm.transport.hello import Limits, ServerInfo

    info = ServerInfo("splitlm/0.1.0", "ab" * 16, Limits(8192, 2048, 67108864))
    meta = info.to_meta()
    assert list(meta) == ["server", "fingerprint", "limits"]
    assert list(meta["limits"]) == ["max_tokens_per_session", "max_tokens_per_forward", "max_frame_bytes"]
    assert ServerInfo.from_meta(meta) == info
    partial = ServerInfo.from_meta(
        {"server": "x", "limits": {"max_frame_bytes": 5, "other": 1, "max_tokens_per_forward": "9"}}
    )
    assert partial.limits == Limits(max_frame_bytes=5)


def test_split_head_results_and_replies_carry_typed_fields():
    """Split-head's logits travel beside the hidden states; every reply's `ref` is a field of its message."""
    res = Result(5, torch.randn(2, 4), cache_len=3, logits=torch.randn(2, 6), ref=11)
    frame = wire(res.to_frame("fp32"))
    got = Result.from_frame(frame, 100)
    assert torch.equal(got.logits, res.logits) and torch.equal(got.hidden, res.hidden)
    assert (got.ref, reply_ref(frame), got.nbytes) == (11, 11, (8 + 12) * 4)
    assert Opened.from_frame(wire(answering(Opened(7, "fp16", CachePolicy(), "tail-local").to_frame(), 4))).ref == 4
    assert PolicyOk.from_frame(wire(PolicyOk(3, CachePolicy(), 0, ref=9).to_frame())).ref == 9
    assert Closed.from_frame(wire(Closed(9, ref=2).to_frame())) == Closed(9, 2)
    assert reply_ref(wire(Closed(9).to_frame())) is None


def test_error_replies_round_trip_and_tolerate_unknown_codes():
    err = ErrorReply.of(ProtocolError(ErrorCode.PREEMPTED, "gone"), session=4, ref=6)
    got = ErrorReply.from_frame(wire(err.to_frame()))
    assert got == err and got.error_code == ErrorCode.PREEMPTED and got.name == "PREEMPTED"
    odd = ErrorReply.from_frame(Frame(MsgType.ERROR, meta={"code": 999, "message": "new", "ref": "x"}))
    assert (odd.code, odd.error_code, odd.name, odd.ref, odd.message) == (999, None, None, None, "new")
    with pytest.raises(ProtocolError):
        ErrorReply.from_frame(Frame(MsgType.RESULT))


def test_no_module_but_the_messages_reads_a_frames_metadata():
    """Clients, servers and edges read typed messages; only the message modules and the codecs
    (frames, crypto) touch `Frame.meta`."""
    allowed = {"transport/messages.py", "transport/hello.py", "transport/frames.py", "transport/crypto.py"}
    readers = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "meta" and rel not in allowed:
                readers.append(f"{rel}:{node.lineno}")
    assert not readers, readers
