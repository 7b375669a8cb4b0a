"""The split-head cloud's part of the protocol: OPEN `vocab`, FORWARD `rows`, the RESULT's two tensors."""

import pytest
import torch
from test_server import Raw, forward_frame

from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits
from splitlm.model.shards import Manifest
from splitlm.transport.errors import ErrorCode
from splitlm.transport.frames import Frame, MsgType, pack_vocab, unpack_tensors

V, D, D_END = 256, 64, 24


@pytest.fixture()
def raw(tiny_split_head, split_head_server):
    r = Raw(split_head_server.url)
    assert r.hello(Manifest.read(tiny_split_head / "edge", "edge").fingerprint).type == MsgType.HELLO_OK
    yield r
    r.close()


def allow(ids) -> bytes:
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[ids] = True
    return pack_vocab(allowed)


@pytest.mark.parametrize("wire", ["fp32", "int8"])
def test_result_holds_h_end_and_partial_logits_for_the_asked_rows(raw, wire):
    opened = raw.send(Frame(MsgType.OPEN, meta={"wire_dtype": wire, "vocab": allow([1, 2, 50, 255])}))
    assert opened.type == MsgType.OPENED and opened.meta["vocab_size"] == 4 and opened.meta["topology"] == "split-head"
    reply = raw.send(forward_frame(opened.session, t=5, rows=[4, 1]))
    assert reply.type == MsgType.RESULT and reply.meta["cache_len"] == 5
    assert {s["name"]: (s["dtype"], s["shape"]) for s in reply.meta["tensors"]} == {
        "hidden": (wire, [2, D_END]),
        "logits": (wire, [2, 4]),
    }
    out = unpack_tensors(reply, 10**6)
    assert torch.isfinite(out["logits"]).all()
    every = raw.send(forward_frame(raw.send(Frame(MsgType.OPEN)).session, t=3))  # no vocab, no rows: all of both
    assert {s["name"]: s["shape"] for s in every.meta["tensors"]} == {"hidden": [3, D_END], "logits": [3, V]}
    nothing = raw.send(forward_frame(opened.session, t=1, positions=[5], rows=[]))
    assert {s["name"]: s["shape"] for s in nothing.meta["tensors"]} == {"hidden": [0, D_END], "logits": [0, 4]}


def test_bad_vocab_and_rows_are_refused_and_change_nothing(raw):
    for vocab in (b"\0" * 32, b"\xff" * 31, "all", allow([0])[:-1] + b"\0\0"):
        assert raw.send(Frame(MsgType.OPEN, meta={"vocab": vocab})).meta["code"] == ErrorCode.BAD_REQUEST
    sid = raw.send(Frame(MsgType.OPEN, meta={"vocab": allow([3])})).session
    assert raw.send(forward_frame(sid, t=2)).meta["cache_len"] == 2
    for rows in ([2], [-1], [0, 0], [0.5], "0"):
        reply = raw.send(forward_frame(sid, t=2, positions=[2, 3], rows=rows))
        assert reply.meta["code"] == ErrorCode.BAD_REQUEST, rows
    assert raw.send(forward_frame(sid, t=1, positions=[2], rows=[0])).meta["cache_len"] == 3  # nothing was appended


def test_a_tail_local_cloud_refuses_vocab_and_rows(tiny_split, tiny_server):
    r = Raw(tiny_server.url)
    r.hello(Manifest.read(tiny_split / "edge", "edge").fingerprint)
    assert r.send(Frame(MsgType.OPEN, meta={"vocab": allow([1])})).meta["code"] == ErrorCode.BAD_REQUEST
    sid = r.send(Frame(MsgType.OPEN)).session
    assert r.send(forward_frame(sid, t=2, rows=[1])).meta["code"] == ErrorCode.BAD_REQUEST
    assert r.send(forward_frame(sid, t=2)).type == MsgType.RESULT
    r.close()


def test_logits_over_the_frame_limit_are_refused_before_computing(tiny_split_head):
    limits = ServerLimits(max_frame_bytes=16 * 1024)  # 3 rows × (256 + 24) fp32 fit, 16 rows do not
    with BackgroundServer(tiny_split_head / "cloud", limits=limits) as server:
        r = Raw(server.url)
        r.hello(Manifest.read(tiny_split_head / "edge", "edge").fingerprint)
        sid = r.send(Frame(MsgType.OPEN, meta={"wire_dtype": "fp32"})).session
        assert r.send(forward_frame(sid, t=16)).meta["code"] == ErrorCode.TOO_LARGE
        assert r.send(forward_frame(sid, t=16, rows=[15, 14, 13])).meta["cache_len"] == 16
        r.close()
