"""The cloud server under hostile and mistaken input: every error is a frame, service goes on."""

import time
import urllib.request

import pytest
import torch
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from conftest import scrape_metrics
from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits
from splitlm.model.shards import Manifest
from splitlm.transport.client import ClientOptions, CloudClient, CloudError
from splitlm.transport.crypto import DirectionKeys, SendCipher
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    FLAG_ENCRYPTED,
    Frame,
    MsgType,
    decode_frame,
    decode_header,
    encode_frame,
    pack_tensors,
)
from splitlm.transport.handshake import ClientHandshake
from splitlm.transport.keys import generate_identity


class Raw:
    """A hand-driven protocol client that can send anything: plaintext frames until `hello` did a real
    handshake (with its own fresh client key unless given one), encrypted frames after it."""

    def __init__(self, url, identity=None, **connect_kwargs):
        self.ws = connect(url, compression=None, proxy=None, **connect_kwargs).__enter__()
        self.seq = 0
        self.identity = identity or generate_identity()
        self.channel = None

    def encode(self, frame: Frame) -> bytes:
        self.seq += 1
        frame.seq = self.seq
        return self.channel.seal(frame) if self.channel is not None else encode_frame(frame)

    def send(self, frame: Frame) -> Frame:
        return self.send_bytes(self.encode(frame))

    def recv(self, timeout=10) -> Frame:
        data = self.ws.recv(timeout=timeout)
        if self.channel is not None and decode_header(data).flags & FLAG_ENCRYPTED:
            return self.channel.open(data)
        return decode_frame(data)

    def send_bytes(self, data) -> Frame:
        self.ws.send(data)
        return self.recv()

    def hello(self, fingerprint):
        self.seq += 1
        hs = ClientHandshake(self.identity, fingerprint, seq=self.seq)
        self.ws.send(hs.hello_bytes)
        data = self.ws.recv(timeout=10)
        reply = decode_frame(data)
        if reply.type == MsgType.HELLO_OK:
            self.channel, self.info = hs.finish(data)
        return reply

    def close(self):
        self.ws.close()


@pytest.fixture()
def fingerprint(tiny_split):
    return Manifest.read(tiny_split / "edge", "edge").fingerprint


def forward_frame(session, t=2, d=64, positions=None, **meta):
    specs, payload = pack_tensors({"hidden": torch.randn(t, d)}, "fp32")
    return Frame(
        MsgType.FORWARD,
        session,
        meta={"tensors": specs, "positions": positions or list(range(t)), **meta},
        payload=payload,
    )


def test_healthz(tiny_server, fingerprint):
    with urllib.request.urlopen(tiny_server.url.replace("ws://", "http://") + "/healthz", timeout=5) as r:
        assert r.status == 200 and fingerprint in r.read().decode()


def test_metrics_count_round_trips_tokens_and_errors(tiny_server, fingerprint):
    def scrape():
        with urllib.request.urlopen(tiny_server.url.replace("ws://", "http://") + "/metrics", timeout=5) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=")
            return scrape_metrics(r.read().decode())

    before = scrape()
    raw = Raw(tiny_server.url)
    raw.hello(fingerprint)
    sid = raw.send(Frame(MsgType.OPEN, meta={"wire_dtype": "fp32"})).session
    raw.send(forward_frame(sid, t=3))
    raw.send(forward_frame(sid, t=2))
    assert scrape()["splitlm_cloud_sessions"] == 1
    raw.send(Frame(MsgType.CLOSE, sid))
    raw.send(Frame(MsgType.CLOSE, sid))  # unknown now: an ERROR frame
    after = scrape()
    assert after["splitlm_cloud_round_trips_total"] - before["splitlm_cloud_round_trips_total"] == 2
    assert after["splitlm_cloud_tokens_total"] - before["splitlm_cloud_tokens_total"] == 5
    assert after['splitlm_cloud_tokens_per_round_trip_bucket{le="2.0"}'] >= 1
    assert after['splitlm_cloud_requests_total{type="FORWARD"}'] >= 2
    assert after['splitlm_cloud_errors_total{code="UNKNOWN_SESSION"}'] >= 1
    assert after["splitlm_cloud_compute_seconds_count"] == after["splitlm_cloud_round_trips_total"]
    assert after["splitlm_cloud_sessions"] == 0


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
    # a replayed frame
    data = raw.encode(Frame(MsgType.CLOSE, 999))
    assert raw.send_bytes(data).meta["code"] == ErrorCode.UNKNOWN_SESSION
    assert raw.send_bytes(data).meta["code"] == ErrorCode.REPLAY
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
        CloudClient("ws://127.0.0.1:9", "x", ClientOptions(timeout_s=5))


def test_handshake_timeout_closes_the_connection(tiny_split):
    from websockets.exceptions import ConnectionClosed

    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(hello_timeout_s=0.5)) as server:
        raw = Raw(server.url)
        assert raw.send(Frame(MsgType.OPEN)).meta["code"] == ErrorCode.NOT_READY
        assert decode_frame(raw.ws.recv(timeout=5)).meta["code"] == ErrorCode.NOT_READY  # the timeout
        with pytest.raises(ConnectionClosed):
            raw.ws.recv(timeout=5)


def test_idle_connections_are_closed(tiny_split, fingerprint):
    import time

    from websockets.exceptions import ConnectionClosed

    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(connection_idle_timeout_s=0.6)) as server:
        raw = Raw(server.url)
        assert raw.hello(fingerprint).type == MsgType.HELLO_OK
        sid = raw.send(Frame(MsgType.OPEN, meta={"wire_dtype": "fp32"})).session
        time.sleep(0.3)
        assert raw.send(forward_frame(sid)).type == MsgType.RESULT  # activity keeps it open
        with pytest.raises(ConnectionClosed):
            raw.ws.recv(timeout=5)  # then silence: closed after the idle timeout
        deadline = time.monotonic() + 5
        while server.server.sessions.sessions and time.monotonic() < deadline:
            time.sleep(0.05)  # the server drops the connection's sessions once its close completes
        assert not server.server.sessions.sessions


# -- authentication and the encrypted channel under attack (issue 5) ---------------------------------------


def test_a_client_without_the_private_key_is_refused(tiny_split, fingerprint):
    """Mallory announces Alice's public key (it is public) but cannot derive the keys."""
    alice, mallory = generate_identity(), generate_identity()

    class Stolen:  # alice's public key, mallory's private key
        public_bytes = alice.public_bytes
        private_key = mallory.private_key

    with BackgroundServer(tiny_split / "cloud", allowed_clients=[alice.public_bytes]) as server:
        raw = Raw(server.url, identity=Stolen())
        with pytest.raises(ProtocolError) as e:
            raw.hello(fingerprint)  # mallory cannot even check the cloud's key confirmation
        assert e.value.code == ErrorCode.AUTH_FAILED
        guess = SendCipher(DirectionKeys(bytes(32), bytes(12)))
        reply = raw.send_bytes(guess.seal(Frame(MsgType.OPEN, seq=2)))
        assert reply.type == MsgType.ERROR and reply.meta["code"] == ErrorCode.AUTH_FAILED  # in the clear
        assert "does not hold the private key" in reply.meta["message"]
        with pytest.raises(ConnectionClosed):
            raw.ws.recv(timeout=5)


def test_a_missing_client_credential_is_refused(tiny_server, fingerprint):
    raw = Raw(tiny_server.url)
    reply = raw.send(
        Frame(MsgType.HELLO, meta={"version": 2, "fingerprint": fingerprint, "e": generate_identity().public_bytes})
    )
    assert reply.meta["code"] == ErrorCode.AUTH_FAILED and "'s'" in reply.meta["message"]
    with pytest.raises(ConnectionClosed):
        raw.ws.recv(timeout=5)


def test_tampered_replayed_reordered_plaintext_and_foreign_frames(tiny_server, fingerprint):
    a, b = Raw(tiny_server.url), Raw(tiny_server.url)
    a.hello(fingerprint)
    b.hello(fingerprint)
    sid = a.send(Frame(MsgType.OPEN, meta={"wire_dtype": "fp32"})).session
    # a tampered byte (in the ciphertext, the tag, the header's session or seq)
    for i in (-1, 40, 12, 20):
        data = bytearray(a.encode(forward_frame(sid, t=2)))
        data[i] ^= 0x01
        reply = a.send_bytes(bytes(data))
        assert reply.meta["code"] == ErrorCode.DECRYPT_FAILED, i
    # a replayed frame
    data = a.encode(forward_frame(sid, t=2))
    assert a.send_bytes(data).type == MsgType.RESULT
    assert a.send_bytes(data).meta["code"] == ErrorCode.REPLAY
    # reordered frames: the later one arrives first
    first, second = a.encode(forward_frame(sid, t=1, positions=[2])), a.encode(forward_frame(sid, t=1, positions=[3]))
    assert a.send_bytes(second).meta["cache_len"] == 3
    assert a.send_bytes(first).meta["code"] == ErrorCode.OUT_OF_ORDER
    # plaintext after the handshake
    a.seq += 1
    assert a.send_bytes(encode_frame(Frame(MsgType.CLOSE, sid, seq=a.seq))).meta["code"] == ErrorCode.NOT_ENCRYPTED
    # another client, knowing the session id, can neither use nor close it
    assert b.send(forward_frame(sid)).meta["code"] == ErrorCode.UNKNOWN_SESSION
    assert b.send(Frame(MsgType.CLOSE, sid)).meta["code"] == ErrorCode.UNKNOWN_SESSION
    # the session survived all of it
    reply = a.send(forward_frame(sid, t=1, positions=[3]))
    assert reply.type == MsgType.RESULT and reply.meta["cache_len"] == 4


def test_sessions_are_counted_per_client_key_and_bound_to_the_connection(tiny_split, fingerprint):
    alice = generate_identity()
    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(max_sessions_per_client=2)) as server:
        a1, a2, other = Raw(server.url, alice), Raw(server.url, alice), Raw(server.url)
        for r in (a1, a2, other):
            r.hello(fingerprint)
        s1 = a1.send(Frame(MsgType.OPEN)).session
        assert a2.send(Frame(MsgType.OPEN)).type == MsgType.OPENED
        assert a2.send(Frame(MsgType.OPEN)).meta["code"] == ErrorCode.LIMIT_EXCEEDED  # 2 for alice, any connection
        assert other.send(Frame(MsgType.OPEN)).type == MsgType.OPENED
        assert a2.send(Frame(MsgType.CLOSE, s1)).meta["code"] == ErrorCode.UNKNOWN_SESSION  # alice, other connection
        a1.close()  # alice's first connection ends: its session goes, so she may open another
        for _ in range(100):
            if len(server.server.sessions.sessions) == 2:
                break
            time.sleep(0.02)
        assert a2.send(Frame(MsgType.OPEN)).type == MsgType.OPENED


def test_too_many_bad_frames_close_the_connection(tiny_split, fingerprint):
    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(max_bad_frames=3)) as server:
        raw = Raw(server.url)
        raw.hello(fingerprint)
        raw.send(Frame(MsgType.OPEN))
        for _ in range(3):
            assert raw.send_bytes(b"garbage").meta["code"] == ErrorCode.BAD_FRAME
        with pytest.raises(ConnectionClosed) as e:
            raw.ws.recv(timeout=5)
        assert e.value.rcvd.code == 1008 and "bad frames" in e.value.rcvd.reason
