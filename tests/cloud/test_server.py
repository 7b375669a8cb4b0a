"""The cloud server under hostile and mistaken input: every error is a frame, service goes on."""

import urllib.request

import pytest
import torch
from websockets.sync.client import connect

from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits
from splitlm.model.shards import Manifest
from splitlm.transport.client import CloudClient, CloudError
from splitlm.transport.errors import ErrorCode
from splitlm.transport.frames import VERSION, Frame, MsgType, decode_frame, encode_frame, pack_tensors


class Raw:
    """A hand-driven protocol client that can send anything."""

    def __init__(self, url):
        self.ws = connect(url, compression=None, proxy=None).__enter__()
        self.seq = 0

    def send(self, frame: Frame) -> Frame:
        self.seq += 1
        frame.seq = self.seq
        return self.send_bytes(encode_frame(frame))

    def send_bytes(self, data) -> Frame:
        self.ws.send(data)
        return decode_frame(self.ws.recv(timeout=10))

    def hello(self, fingerprint):
        return self.send(Frame(MsgType.HELLO, meta={"version": VERSION, "fingerprint": fingerprint}))


@pytest.fixture()
def fingerprint(tiny_split):
    return Manifest.read(tiny_split / "edge", "edge").fingerprint


def forward_frame(session, t=2, d=64, positions=None, **meta):
    specs, payload = pack_tensors({"hidden": torch.randn(t, d)}, "fp32")
    return Frame(MsgType.FORWARD, session, meta={"tensors": specs, "positions": positions or list(range(t)), **meta},
                 payload=payload)


def test_healthz(tiny_server, fingerprint):
    with urllib.request.urlopen(tiny_server.url.replace("ws://", "http://") + "/healthz", timeout=5) as r:
        assert r.status == 200 and fingerprint in r.read().decode()


def test_session_forward_and_close(tiny_server, fingerprint):
    raw = Raw(tiny_server.url)
    assert raw.hello(fingerprint).type == MsgType.HELLO_OK
    sid = raw.send(Frame(MsgType.OPEN, meta={"wire_dtype": "fp32"})).session
    reply = raw.send(forward_frame(sid, t=3))
    assert reply.type == MsgType.RESULT and reply.meta["cache_len"] == 3 and reply.meta["ref"] == raw.seq
    assert raw.send(Frame(MsgType.CLOSE, sid)).type == MsgType.CLOSED
    assert raw.send(forward_frame(sid)).meta["code"] == ErrorCode.UNKNOWN_SESSION


def test_bad_input_gets_error_frames_and_the_server_keeps_serving(tiny_server, fingerprint):
    raw = Raw(tiny_server.url)
    assert raw.send(Frame(MsgType.OPEN)).meta["code"] == ErrorCode.NOT_READY  # before HELLO
    raw.hello(fingerprint)
    sid = raw.send(Frame(MsgType.OPEN, meta={"wire_dtype": "fp32"})).session
    cases = {
        "garbage": (b"\x00garbage", ErrorCode.BAD_FRAME),
        "text": ("hello", ErrorCode.BAD_FRAME),
    }
    for _, (data, code) in cases.items():
        assert raw.send_bytes(data).meta["code"] == code
    frames = [
        (forward_frame(12345), ErrorCode.UNKNOWN_SESSION),
        (forward_frame(sid, d=63), ErrorCode.BAD_REQUEST),  # wrong hidden size
        (forward_frame(sid, t=2, positions=[0]), ErrorCode.BAD_REQUEST),
        (forward_frame(sid, positions=[0, 10**9]), ErrorCode.BAD_REQUEST),
        (forward_frame(sid, mask=b"\x01\x02\x03"), ErrorCode.BAD_REQUEST),
        (forward_frame(sid, keep=[5]), ErrorCode.BAD_REQUEST),
        (forward_frame(sid, crop=99), ErrorCode.BAD_REQUEST),
        (forward_frame(sid, t=3000), ErrorCode.TOO_LARGE),
        (Frame(MsgType.FORWARD, sid, meta={"positions": [0]}), ErrorCode.BAD_REQUEST),  # no tensor
        (Frame(MsgType.OPEN, meta={"wire_dtype": "int3"}), ErrorCode.BAD_REQUEST),
        (Frame(MsgType.OPEN, meta={"wire_dtype": ["fp16"]}), ErrorCode.BAD_REQUEST),
        (forward_frame(sid, positions=[0.5, 1.0]), ErrorCode.BAD_REQUEST),
        (forward_frame(sid, keep="0"), ErrorCode.BAD_REQUEST),
        (forward_frame(sid, crop="0"), ErrorCode.BAD_REQUEST),
        (Frame(MsgType.RESULT, sid), ErrorCode.BAD_REQUEST),
    ]
    for frame, code in frames:
        reply = raw.send(frame)
        assert reply.type == MsgType.ERROR and reply.meta["code"] == code, (frame.meta, reply.meta)
        assert reply.meta["message"]
    # replayed sequence number
    raw.seq -= 1
    assert raw.send(forward_frame(sid)).meta["code"] == ErrorCode.BAD_FRAME
    raw.seq += 1
    # the session is intact and still serves
    reply = raw.send(forward_frame(sid, t=4))
    assert reply.type == MsgType.RESULT and reply.meta["cache_len"] == 4


def test_sessions_are_bound_to_their_connection(tiny_server, fingerprint):
    a, b = Raw(tiny_server.url), Raw(tiny_server.url)
    a.hello(fingerprint)
    b.hello(fingerprint)
    sid = a.send(Frame(MsgType.OPEN, meta={"wire_dtype": "fp32"})).session
    assert b.send(forward_frame(sid)).meta["code"] == ErrorCode.UNKNOWN_SESSION
    assert b.send(Frame(MsgType.CLOSE, sid)).meta["code"] == ErrorCode.UNKNOWN_SESSION
    assert a.send(forward_frame(sid)).type == MsgType.RESULT


def test_fingerprint_mismatch_is_refused(tiny_server):
    with pytest.raises(CloudError, match="different splits"):
        CloudClient(tiny_server.url, "0" * 32)


def test_limits(tiny_split, fingerprint):
    limits = ServerLimits(max_sessions=3, max_sessions_per_client=2, max_tokens_per_session=6)
    with BackgroundServer(tiny_split / "cloud", limits=limits) as server:
        a, b = Raw(server.url), Raw(server.url)
        a.hello(fingerprint)
        b.hello(fingerprint)
        s1 = a.send(Frame(MsgType.OPEN)).session
        a.send(Frame(MsgType.OPEN))
        assert a.send(Frame(MsgType.OPEN)).meta["code"] == ErrorCode.LIMIT_EXCEEDED  # per client
        b.send(Frame(MsgType.OPEN))
        assert b.send(Frame(MsgType.OPEN)).meta["code"] == ErrorCode.LIMIT_EXCEEDED  # whole server
        assert a.send(forward_frame(s1, t=4)).type == MsgType.RESULT
        assert a.send(forward_frame(s1, t=3, positions=[0, 1, 2])).meta["code"] == ErrorCode.LIMIT_EXCEEDED


def test_server_not_running():
    with pytest.raises(CloudError, match="cannot reach the cloud"):
        CloudClient("ws://127.0.0.1:9", "x", timeout_s=5)


def test_handshake_timeout_closes_the_connection(tiny_split):
    from websockets.exceptions import ConnectionClosed

    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(hello_timeout_s=0.5)) as server:
        raw = Raw(server.url)
        assert raw.send(Frame(MsgType.OPEN)).meta["code"] == ErrorCode.NOT_READY
        assert decode_frame(raw.ws.recv(timeout=5)).meta["code"] == ErrorCode.NOT_READY  # the timeout
        with pytest.raises(ConnectionClosed):
            raw.ws.recv(timeout=5)
