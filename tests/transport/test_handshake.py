"""The handshake in memory and against a live cloud: who is authenticated, what is refused, and how."""

import datetime
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from splitlm.cloud.server import BackgroundServer
from splitlm.edge import Edge, EdgeConfig
from splitlm.transport.client import ClientOptions, CloudClient, CloudError
from splitlm.transport.crypto import RekeyPolicy
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import Frame, MsgType, decode_frame, encode_frame
from splitlm.transport.handshake import ClientHandshake, server_handshake
from splitlm.transport.hello import Hello, ServerInfo
from splitlm.transport.keys import KnownHosts, generate_identity, write_identity

SHARD_FP = "0ea3882e8a74dced859753008aee3085"
INFO = {"server": "test", "fingerprint": SHARD_FP, "limits": {}}


def handshake(client=None, server=None):
    client, server = client or generate_identity(), server or generate_identity()
    hs = ClientHandshake(client, SHARD_FP)
    hello = Hello.from_frame(decode_frame(hs.hello_bytes), SHARD_FP)
    ok, server_channel, client_key = server_handshake(server, hello, hs.hello_bytes, ServerInfo.from_meta(INFO), 1)
    return hs, ok, server_channel, client_key


def test_both_sides_derive_the_same_keys():
    client = generate_identity()
    hs, ok, server_channel, client_key = handshake(client)
    assert client_key == client.public_bytes
    channel, info = hs.finish(ok)
    assert info == INFO
    assert server_channel.open(channel.seal(Frame(MsgType.OPEN, seq=2, meta={"x": 1}))).meta == {"x": 1}
    assert channel.open(server_channel.seal(Frame(MsgType.OPENED, 9, seq=2))).session == 9
    assert channel.send.keys != channel.recv.keys  # one key per direction
    hs2, ok2, _, _ = handshake(client)
    assert hs2.finish(ok2)[0].send.keys != channel.send.keys  # fresh ephemeral keys each time


def test_an_impostor_cloud_without_the_private_key_fails_confirmation():
    real, impostor = generate_identity(), generate_identity()
    hs, ok, _, _ = handshake(server=impostor)
    forged = ok.replace(impostor.public_bytes, real.public_bytes)  # claims the real key, cannot prove it
    assert ClientHandshake.server_key(decode_frame(forged)) == real.public_bytes
    with pytest.raises(ProtocolError) as e:
        hs.finish(forged)
    assert e.value.code == ErrorCode.AUTH_FAILED and "failed to prove" in e.value.message


@pytest.mark.parametrize("where", ["hello-e", "hello-fingerprint", "ok-e", "ok-ref", "ok-payload"])
def test_a_tampered_handshake_fails_confirmation(where):
    client, server = generate_identity(), generate_identity()
    hs = ClientHandshake(client, SHARD_FP)
    hello = bytearray(hs.hello_bytes)
    if where == "hello-e":
        hello[bytes(hello).index(b"\xa1e\xc4\x20") + 4] ^= 1  # first byte of e_c
    elif where == "hello-fingerprint":
        i = bytes(hello).index(SHARD_FP.encode())
        hello[i : i + 1] = b"f"
    ok, _, _ = server_handshake(
        server, Hello.from_frame(decode_frame(bytes(hello))), bytes(hello), ServerInfo.from_meta(INFO), 1
    )
    ok = bytearray(ok)
    if where == "ok-e":
        ok[bytes(ok).index(b"\xa1e\xc4\x20") + 10] ^= 0x40
    elif where == "ok-ref":
        ok[bytes(ok).index(b"\xa3ref") + 4] = 2
    elif where == "ok-payload":
        ok[-1] ^= 1
    with pytest.raises(ProtocolError) as e:
        hs.finish(bytes(ok))
    assert e.value.code == ErrorCode.AUTH_FAILED


def test_missing_malformed_and_degenerate_client_keys():
    ident = generate_identity()
    base = {"version": 2, "fingerprint": SHARD_FP, "e": generate_identity().public_bytes, "s": ident.public_bytes}
    for meta, code in [
        ({**base, "s": None}, ErrorCode.AUTH_FAILED),
        ({**base, "s": b"short"}, ErrorCode.AUTH_FAILED),
        ({**base, "e": "text"}, ErrorCode.BAD_REQUEST),
    ]:
        with pytest.raises(ProtocolError) as e:
            Hello.from_frame(Frame(MsgType.HELLO, meta={k: v for k, v in meta.items() if v is not None}), SHARD_FP)
        assert e.value.code == code
    low_order = bytes(32)  # the all-zero point: X25519 gives an all-zero secret
    hello = encode_frame(Frame(MsgType.HELLO, seq=1, meta={**base, "e": low_order}))
    with pytest.raises(ProtocolError) as e:
        server_handshake(generate_identity(), Hello.from_frame(decode_frame(hello)), hello, ServerInfo(), 1)
    assert e.value.code == ErrorCode.AUTH_FAILED and "low-order" in e.value.message


def test_hello_is_checked_in_the_documented_order():
    """§5 step 2: version, then the shard fingerprint, then s, then e (each check before the next)."""
    ident = generate_identity()
    hello = Hello(SHARD_FP, generate_identity().public_bytes, ident.public_bytes, seq=3)
    frame = hello.to_frame()
    assert list(frame.meta) == ["version", "fingerprint", "e", "s"] and frame.seq == 3
    assert Hello.from_frame(decode_frame(encode_frame(frame)), SHARD_FP) == hello
    cases = [
        ({"version": 1, "fingerprint": "x", "s": None}, ErrorCode.VERSION_MISMATCH),
        ({"fingerprint": "x", "s": None}, ErrorCode.FINGERPRINT_MISMATCH),
        ({"s": None, "e": "text"}, ErrorCode.AUTH_FAILED),
    ]
    for change, code in cases:
        meta = {k: v for k, v in {**frame.meta, **change}.items() if v is not None}
        with pytest.raises(ProtocolError) as e:
            Hello.from_frame(Frame(MsgType.HELLO, meta=meta), SHARD_FP)
        assert e.value.code == code, change
    assert "different splits" in str(
        pytest.raises(
            ProtocolError, Hello.from_frame, Frame(MsgType.HELLO, meta={**frame.meta, "fingerprint": "x"}), SHARD_FP
        ).value
    )


# -- against a live cloud ------------------------------------------------------------------------------------


@pytest.fixture()
def keys(tmp_path):
    """A cloud identity, an allowed client and an unlisted client, as files."""
    out = {}
    for name in ("cloud", "alice", "mallory"):
        out[name] = generate_identity()
        write_identity(tmp_path / name, out[name])
    (tmp_path / "clients").write_text(out["alice"].public_line("alice") + "\n")
    return out


@pytest.fixture()
def locked_server(tiny_split, keys, tmp_path):
    with BackgroundServer(
        tiny_split / "cloud", identity=tmp_path / "cloud.key", allowed_clients=tmp_path / "clients"
    ) as server:
        yield server


def shard_fp(tiny_split):
    from splitlm.model.shards import Manifest

    return Manifest.read(tiny_split / "edge", "edge").fingerprint


def expect(code, fn, *args, **kwargs):
    with pytest.raises(CloudError) as e:
        fn(*args, **kwargs)
    assert e.value.code == code, e.value
    return str(e.value)


def test_pinned_cloud_key(tiny_split, locked_server, keys, tmp_path):
    fp = shard_fp(tiny_split)
    options = ClientOptions(identity=tmp_path / "alice.key", cloud_key=tmp_path / "cloud.pub")
    client = CloudClient(locked_server.url, fp, options)
    assert client.cloud_fingerprint == keys["cloud"].fingerprint == locked_server.fingerprint
    assert client.info.fingerprint == fp
    client.close()
    msg = expect(
        ErrorCode.SERVER_KEY_MISMATCH,
        CloudClient,
        locked_server.url,
        fp,
        ClientOptions(identity=tmp_path / "alice.key", cloud_key=keys["mallory"].fingerprint),
    )
    assert keys["cloud"].fingerprint in msg and "--cloud-key" in msg


def test_trust_on_first_use_and_a_changed_key(tiny_split, tmp_path):
    fp, hosts = shard_fp(tiny_split), tmp_path / "known_hosts"
    first, second = generate_identity(), generate_identity()
    with BackgroundServer(tiny_split / "cloud", identity=first) as server:
        url, port = server.url, server.server.port
        CloudClient(url, fp, ClientOptions(known_hosts=hosts)).close()
        assert hosts.read_text() == f"127.0.0.1:{port} {first.fingerprint}\n"
        CloudClient(url, fp, ClientOptions(known_hosts=hosts)).close()  # known and unchanged
    with BackgroundServer(tiny_split / "cloud", identity=second, port=port) as server:
        msg = expect(ErrorCode.SERVER_KEY_MISMATCH, CloudClient, url, fp, ClientOptions(known_hosts=hosts))
        assert str(hosts) in msg and "line 1" in msg and second.fingerprint in msg
        hosts.write_text("# the cloud was re-keyed; old line removed by hand\n")
        CloudClient(url, fp, ClientOptions(known_hosts=hosts)).close()
        assert KnownHosts(hosts).lookup(f"127.0.0.1:{port}") == (2, second.fingerprint)


def test_an_unlisted_client_is_refused(tiny_split, locked_server, tmp_path, keys):
    msg = expect(
        ErrorCode.UNKNOWN_CLIENT,
        CloudClient,
        locked_server.url,
        shard_fp(tiny_split),
        ClientOptions(identity=tmp_path / "mallory.key", cloud_key=locked_server.fingerprint),
    )
    assert keys["mallory"].fingerprint in msg and "allowed clients" in msg


def test_generation_through_rotating_keys_is_unchanged(tiny_split):
    policy = RekeyPolicy(max_frames=2)
    with BackgroundServer(tiny_split / "cloud", rekey=policy) as server:
        with Edge(tiny_split / "edge", server.url, EdgeConfig(wire_dtype="fp32", cloud_key=server.fingerprint)) as edge:
            baseline = edge.generate([5, 6, 7], max_new_tokens=8, stop_at_eos=False).token_ids
        with Edge(
            tiny_split / "edge", server.url, EdgeConfig(wire_dtype="fp32", cloud_key=server.fingerprint, rekey=policy)
        ) as edge:
            assert edge.generate([5, 6, 7], max_new_tokens=8, stop_at_eos=False).token_ids == baseline
            channel = edge.client.channel
            assert channel.send.rotations >= 4 and channel.recv.rotations >= 4


# -- TLS on top --------------------------------------------------------------------------------------------


def self_signed(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitlm test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return tmp_path / "cert.pem", tmp_path / "key.pem"


def test_wss_on_top_of_the_encryption(tiny_split, tmp_path):
    cert, key = self_signed(tmp_path)
    with BackgroundServer(tiny_split / "cloud", tls_cert=cert, tls_key=key) as server:
        assert server.url.startswith("wss://")
        with Edge(
            tiny_split / "edge", server.url, EdgeConfig(wire_dtype="fp32", tls_ca=cert, cloud_key=server.fingerprint)
        ) as edge:
            assert len(edge.generate([5, 6, 7], max_new_tokens=3, stop_at_eos=False).token_ids) == 3
        pinned = ClientOptions(timeout_s=5, cloud_key=server.fingerprint)
        msg = expect(None, CloudClient, server.url, shard_fp(tiny_split), pinned)
        assert "CERTIFICATE_VERIFY_FAILED" in msg  # not signed by a CA the system trusts
        expect(
            None, CloudClient, server.url.replace("wss://", "ws://"), shard_fp(tiny_split), ClientOptions(timeout_s=5)
        )
    with pytest.raises(CloudError, match="not a wss:// URL"):
        CloudClient("ws://127.0.0.1:9", "x", ClientOptions(tls_ca=cert))
