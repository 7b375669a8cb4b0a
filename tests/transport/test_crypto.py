"""AES-256-GCM framing: round trips, tampering, replay and reordering, rekeying, the documented test
vector, property tests against the parsers, and a capture of the bytes on the wire."""

import re
from pathlib import Path

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitlm.transport.crypto import (
    IV_SIZE,
    TAG_SIZE,
    DirectionKeys,
    RecvCipher,
    RekeyPolicy,
    ReplayWindow,
    SendCipher,
    derive_keys,
    next_keys,
    nonce,
    transcript_hash,
)
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    FLAG_ENCRYPTED,
    FLAG_KEY_PHASE,
    HEADER,
    HEADER_SIZE,
    Frame,
    MsgType,
    decode_frame,
    decode_header,
    encode_frame,
    pack_tensors,
    unpack_tensors,
)
from splitlm.transport.handshake import ClientHandshake, server_handshake
from splitlm.transport.hello import Hello, Limits, ServerInfo
from splitlm.transport.keys import Identity

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
KEYS = DirectionKeys(bytes(range(32)), bytes(range(100, 112)))


def pair(policy: RekeyPolicy | None = None) -> tuple[SendCipher, RecvCipher]:
    return SendCipher(KEYS, policy), RecvCipher(KEYS)


def forward(seq: int, t: int = 3) -> Frame:
    specs, payload = pack_tensors({"hidden": torch.randn(t, 8)}, "fp32")
    return Frame(
        MsgType.FORWARD, session=77, seq=seq, meta={"tensors": specs, "positions": list(range(t))}, payload=payload
    )


def test_sealed_frame_layout_and_round_trip():
    send, recv = pair()
    frame = forward(1)
    data = send.seal(frame)
    header = decode_header(data)
    meta = msgpack.packb(frame.meta, use_bin_type=True)
    assert header.flags == FLAG_ENCRYPTED and (header.session, header.seq) == (77, 1)
    assert (header.meta_len, header.payload_len) == (len(meta), len(frame.payload) + TAG_SIZE)
    assert len(data) == HEADER_SIZE + header.meta_len + header.payload_len
    assert frame.payload not in data and b"positions" not in data  # metadata is encrypted too
    back = recv.open(data)
    assert (back.type, back.session, back.seq, back.meta, back.payload) == (
        frame.type,
        77,
        1,
        frame.meta,
        frame.payload,
    )
    with pytest.raises(ProtocolError):
        decode_frame(data)  # the plaintext decoder refuses an encrypted frame


def test_nonce_is_iv_xor_counter_and_never_reused():
    assert nonce(bytes(12), 1) == bytes(11) + b"\x01"
    assert nonce(bytes.fromhex("ff" * 12), 2**64 - 1) == bytes.fromhex("ff" * 4) + bytes(8)
    assert len({nonce(KEYS.iv, s) for s in range(1, 1000)}) == 999
    send, _ = pair()
    send.seal(forward(5))
    for seq in (5, 4):
        with pytest.raises(RuntimeError):
            send.seal(forward(seq))


def test_every_flipped_bit_is_rejected():
    send, recv = pair()
    data = send.seal(forward(1, t=1))
    for i in range(len(data)):
        for bit in (0, 7):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            with pytest.raises(ProtocolError) as e:
                recv.open(bytes(bad))
            assert e.value.code in (
                ErrorCode.DECRYPT_FAILED,
                ErrorCode.BAD_FRAME,
                ErrorCode.VERSION_MISMATCH,
                ErrorCode.NOT_ENCRYPTED,
            ), i
            if i >= HEADER_SIZE or 8 <= i < 24:  # body, session, seq: only authentication can tell
                assert e.value.code == ErrorCode.DECRYPT_FAILED
    assert recv.open(data).seq == 1  # nothing of the rejected frames stuck


def test_truncated_and_extended_frames_are_rejected():
    send, recv = pair()
    data = send.seal(forward(1))
    for bad in (data[:-1], data[: HEADER_SIZE + 5], data + b"\x00"):
        with pytest.raises(ProtocolError) as e:
            recv.open(bad)
        assert e.value.code == ErrorCode.BAD_FRAME  # the lengths no longer add up
    # consistent lengths, shortened ciphertext: authentication fails
    h = decode_header(data)
    short = HEADER.pack(b"SPLM", 2, h.type, h.flags, h.session, h.seq, h.meta_len, h.payload_len - 1) + data[32:-1]
    with pytest.raises(ProtocolError) as e:
        recv.open(short)
    assert e.value.code == ErrorCode.DECRYPT_FAILED
    tiny = HEADER.pack(b"SPLM", 2, h.type, h.flags, h.session, h.seq, 0, 15) + bytes(15)
    with pytest.raises(ProtocolError, match="shorter than its authentication tag"):
        recv.open(tiny)


def test_replayed_and_reordered_frames_get_their_own_errors():
    send, recv = pair()
    frames = [send.seal(forward(seq)) for seq in (1, 2, 3, 4)]
    recv.open(frames[0])
    recv.open(frames[2])  # 2 is held back
    with pytest.raises(ProtocolError) as e:
        recv.open(frames[1])
    assert e.value.code == ErrorCode.OUT_OF_ORDER
    with pytest.raises(ProtocolError) as e:
        recv.open(frames[2])
    assert e.value.code == ErrorCode.REPLAY
    assert recv.open(frames[3]).seq == 4


def test_replay_window():
    w = ReplayWindow()
    with pytest.raises(ProtocolError) as e:
        w.accept(0)
    assert e.value.code == ErrorCode.BAD_FRAME
    for seq in (1, 2, 5, 200):
        w.accept(seq)
    for seq, code in (
        (200, ErrorCode.REPLAY),
        (199, ErrorCode.OUT_OF_ORDER),
        (137, ErrorCode.OUT_OF_ORDER),
        (136, ErrorCode.REPLAY),
        (5, ErrorCode.REPLAY),
        (3, ErrorCode.REPLAY),
    ):
        with pytest.raises(ProtocolError) as e:
            w.accept(seq)
        assert e.value.code == code, seq


def test_plaintext_after_the_handshake_is_refused():
    _, recv = pair()
    with pytest.raises(ProtocolError) as e:
        recv.open(encode_frame(Frame(MsgType.OPEN, seq=1)))
    assert e.value.code == ErrorCode.NOT_ENCRYPTED


def test_wrong_key_fails_authentication():
    send, _ = pair()
    other = RecvCipher(DirectionKeys(bytes(32), KEYS.iv))
    with pytest.raises(ProtocolError) as e:
        other.open(send.seal(forward(1)))
    assert e.value.code == ErrorCode.DECRYPT_FAILED


def test_rekey_by_frame_count_and_by_bytes():
    send, recv = pair(RekeyPolicy(max_frames=3))
    phases = []
    for seq in range(1, 11):
        data = send.seal(forward(seq))
        phases.append(bool(decode_header(data).flags & FLAG_KEY_PHASE))
        assert recv.open(data).seq == seq
    assert phases == [False] * 3 + [True] * 3 + [False] * 3 + [True]
    assert send.rotations == recv.rotations == 3
    assert send.keys == recv.keys != KEYS and next_keys(KEYS) != KEYS
    send, recv = pair(RekeyPolicy(max_bytes=100))  # each forward(…, t=3) has 96 bytes of payload
    for seq in range(1, 5):
        recv.open(send.seal(forward(seq)))
    assert send.rotations == recv.rotations == 3


def test_old_key_frames_are_refused_after_a_rekey():
    send, recv = pair(RekeyPolicy(max_frames=1))
    first = send.seal(forward(1))
    recv.open(first)
    recv.open(send.seal(forward(2)))  # phase 1
    recv.open(send.seal(forward(3)))  # phase 0 again, third key
    with pytest.raises(ProtocolError) as e:
        recv.open(first)  # replay from the first key: that key is gone
    assert e.value.code == ErrorCode.DECRYPT_FAILED
    forged = bytearray(send.seal(forward(4)))
    forged[6:8] = (int.from_bytes(forged[6:8], "big") ^ FLAG_KEY_PHASE).to_bytes(2, "big")
    with pytest.raises(ProtocolError) as e:
        recv.open(bytes(forged))  # a flipped phase bit makes the receiver try the next key, which fails...
    assert e.value.code == ErrorCode.DECRYPT_FAILED
    assert recv.rotations == 2  # ...and it did not move on


def test_rekey_policy_validation():
    with pytest.raises(ValueError):
        RekeyPolicy(max_frames=0)


# -- the documented test vector (docs/protocol.md, section 11) ----------------------------------------------


def doc_vector():
    section = DOC[DOC.index("## 11. Test vector") :]
    keys = {m[0]: m[1] for m in re.findall(r"^\| `(\w+)` \| `([0-9a-f]{64})` \|", section, re.M)}
    blocks = re.findall(r"```text\n(.*?)```", section, re.S)
    values = dict(re.findall(r"^(X25519\(\w+, \w+\)|\S+)\s+= ([0-9a-f]+)$", blocks[1], re.M))
    hello = bytes.fromhex(re.search(r"```text\n([0-9a-f]+)\n```", DOC[DOC.index("## 10. Worked") :]).group(1))
    return keys, hello, bytes.fromhex(blocks[0].strip()), values, bytes.fromhex(blocks[2].strip())


def test_documented_test_vector(monkeypatch):
    keys, hello, ok, values, open_frame = doc_vector()
    priv = {k: X25519PrivateKey.from_private_bytes(bytes.fromhex(v)) for k, v in keys.items()}
    client, server = Identity(priv["s_c"]), Identity(priv["S_s"])
    hs = ClientHandshake(client, "0ea3882e8a74dced859753008aee3085")
    hs.ephemeral = priv["e_c"]
    hs.hello_bytes = encode_frame(
        Frame(
            MsgType.HELLO,
            seq=1,
            meta={
                "version": 2,
                "fingerprint": "0ea3882e8a74dced859753008aee3085",
                "e": Identity(priv["e_c"]).public_bytes,
                "s": client.public_bytes,
            },
        )
    )
    assert hs.hello_bytes == hello
    monkeypatch.setattr(X25519PrivateKey, "generate", staticmethod(lambda: priv["e_s"]))
    info = {
        "server": "splitlm/0.1.0",
        "fingerprint": "0ea3882e8a74dced859753008aee3085",
        "limits": {"max_tokens_per_session": 8192, "max_tokens_per_forward": 2048, "max_frame_bytes": 67108864},
    }
    assert ServerInfo.from_meta(info) == ServerInfo("splitlm/0.1.0", info["fingerprint"], Limits(8192, 2048, 67108864))
    ok_bytes, server_channel, client_key = server_handshake(
        server, Hello.from_frame(decode_frame(hello)), hello, ServerInfo.from_meta(info), 1
    )
    assert ok_bytes == ok and client_key == client.public_bytes
    th = transcript_hash(hello, ok[: HEADER_SIZE + decode_header(ok).meta_len])
    assert th.hex() == values["th"]
    dh = [priv[a].exchange(priv[b].public_key()) for a, b in (("e_c", "e_s"), ("e_c", "S_s"), ("s_c", "e_s"))]
    assert [d.hex() for d in dh] == [
        values[f"X25519({a}, {b})"] for a, b in (("e_c", "e_s"), ("e_c", "S_s"), ("s_c", "e_s"))
    ]
    c2s, s2c = derive_keys(*dh, th)
    assert (c2s.key.hex(), c2s.iv.hex(), s2c.key.hex(), s2c.iv.hex()) == (
        values["k_c2s"],
        values["IV_c2s"],
        values["k_s2c"],
        values["IV_s2c"],
    )
    channel, got_info = hs.finish(ok)
    assert got_info == info
    assert channel.seal(Frame(MsgType.OPEN, seq=2, meta={"wire_dtype": "fp32"})) == open_frame
    assert server_channel.open(open_frame).meta == {"wire_dtype": "fp32"}
    assert len(c2s.iv) == IV_SIZE


# -- property tests against the parsers -----------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def only_protocol_errors(fn, *args):
    try:
        return fn(*args)
    except ProtocolError:
        return None


@FUZZ
@given(st.binary(max_size=200))
def test_decoders_raise_only_protocol_errors_on_random_bytes(data):
    only_protocol_errors(decode_frame, data)
    only_protocol_errors(RecvCipher(KEYS).open, data)


@FUZZ
@given(st.binary(min_size=32, max_size=32), st.binary(max_size=120))
def test_random_bodies_behind_a_valid_looking_header(header, body):
    head = bytearray(header)
    head[:5] = b"SPLM\x02"
    head[24:32] = HEADER.pack(b"SPLM", 2, 1, 0, 0, 0, len(body) // 2, len(body) - len(body) // 2)[24:32]
    data = bytes(head) + body
    only_protocol_errors(decode_frame, data)
    assert only_protocol_errors(RecvCipher(KEYS).open, data) is None  # no key: never accepted


SEALED = SendCipher(KEYS).seal(forward(1))


@FUZZ
@given(st.data())
def test_mutated_sealed_frames_are_never_accepted(data):
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice", "replace"]))
    buf = bytearray(SEALED)
    if kind == "flip":
        for i in data.draw(st.lists(st.integers(0, len(buf) - 1), min_size=1, max_size=4)):
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    elif kind == "extend":
        buf += data.draw(st.binary(min_size=1, max_size=64))
    elif kind == "splice":
        i = data.draw(st.integers(0, len(buf) - 1))
        buf = buf[:i] + data.draw(st.binary(min_size=1, max_size=16)) + buf[i + 1 :]
    else:
        i = data.draw(st.integers(0, len(buf) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=8))
        buf[i : i + len(chunk)] = chunk
    if bytes(buf) == SEALED:
        return
    with pytest.raises(ProtocolError):
        RecvCipher(KEYS).open(bytes(buf))


tensor_spec = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.text(max_size=8), st.integers(), st.none()),
        "dtype": st.one_of(st.sampled_from(["fp32", "fp16", "bf16", "int8"]), st.integers()),
        "shape": st.one_of(st.lists(st.integers(-2, 70), max_size=3), st.text(max_size=3), st.integers()),
        "offset": st.one_of(st.integers(-10, 600), st.text(max_size=2)),
        "nbytes": st.one_of(st.integers(-10, 600), st.none()),
    },
)


@FUZZ
@given(st.one_of(st.lists(tensor_spec, max_size=3), st.integers(), st.text(max_size=4)), st.binary(max_size=512))
def test_tensor_descriptions_raise_only_protocol_errors(specs, payload):
    out = only_protocol_errors(unpack_tensors, Frame(MsgType.FORWARD, meta={"tensors": specs}, payload=payload), 256)
    if out is not None:
        assert all(t.numel() <= 256 for t in out.values())


# -- a capture of the wire --------------------------------------------------------------------------------


def test_the_wire_carries_no_plaintext_hidden_states(tiny_split, tiny_server, monkeypatch):
    """Through the WAN emulator, the prompt's hidden-state bytes never appear in the clear; they are
    in the plaintext the edge sealed (so the search would find them if encryption were missing)."""
    from splitlm.bench.wan import WanConfig, WanEmulator
    from splitlm.edge import Edge, EdgeConfig

    sealed: list[bytes] = []
    original = SendCipher.encrypt

    def recording(self, seq, plaintext, aad):
        sealed.append(bytes(plaintext))
        return original(self, seq, plaintext, aad)

    monkeypatch.setattr(SendCipher, "encrypt", recording)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    host, port = tiny_server.url.removeprefix("ws://").split(":")
    with WanEmulator(upstream=(host, int(port)), config=WanConfig(rtt_ms=0), capture=True) as wan:
        with Edge(
            tiny_split / "edge", wan.url_for("ws"), EdgeConfig(wire_dtype="fp32", cloud_key=tiny_server.fingerprint)
        ) as edge:
            result = edge.generate(prompt, max_new_tokens=4, stop_at_eos=False)
            with torch.inference_mode():
                hidden = edge.model.embed_and_head(
                    torch.tensor([prompt]), torch.arange(len(prompt)), None, edge.model.head.new_cache()
                )[0]
        up, down = wan.captured_up, wan.captured_down
    assert len(result.token_ids) == 4
    plain = hidden.float().contiguous().numpy().tobytes()
    assert len(plain) == len(prompt) * 64 * 4 and len(up) > len(plain)
    assert any(plain in p for p in sealed)  # the test can see the tensor where it is in the clear...
    rows = [plain[i : i + 64 * 4] for i in range(0, len(plain), 64 * 4)]
    for row in rows:  # ...and no token's hidden state (nor any 16-byte piece of it) is on the wire
        assert row not in up and row not in down
        for j in range(0, len(row), 16):
            assert row[j : j + 16] not in up
    assert b"positions" not in up and b"hidden" not in up and b"tensors" not in down
