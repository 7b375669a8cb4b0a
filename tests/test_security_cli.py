"""Keys on the command line: keygen, serve-cloud --identity/--clients/--tls-*, and the edge's --identity,
--cloud-key and known_hosts; an allowed client's output is unchanged by the encryption."""

import json
import re
import stat
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from conftest import hf_greedy
from splitlm.cli import main
from splitlm.cloud.server import BackgroundServer
from splitlm.edge import Edge, EdgeConfig
from splitlm.transport.keys import load_identity, read_public_key


def keygen(capsys, prefix):
    assert main(["keygen", "--out", str(prefix)]) == 0
    out = capsys.readouterr()
    return out.out.strip(), out.err


@pytest.fixture()
def keys(tmp_path, capsys):
    """cloud, alice (allowed) and mallory (not), made with `splitlm keygen`; clients file lists alice."""
    fps = {name: keygen(capsys, tmp_path / name)[0] for name in ("cloud", "alice", "mallory")}
    (tmp_path / "clients").write_text("# allowed\n" + (tmp_path / "alice.pub").read_text())
    return fps


@pytest.fixture()
def locked_server(tiny_split, tmp_path, keys):
    with BackgroundServer(
        tiny_split / "cloud", identity=tmp_path / "cloud.key", allowed_clients=tmp_path / "clients"
    ) as server:
        yield server


def test_keygen_writes_a_private_key_and_a_one_line_public_key(tmp_path, capsys):
    fp, err = keygen(capsys, tmp_path / "k")
    key, pub = tmp_path / "k.key", tmp_path / "k.pub"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and str(key) in err
    assert re.fullmatch(r"SHA256:[A-Za-z0-9+/]{43}", fp)
    assert load_identity(key).fingerprint == fp and len(pub.read_text().splitlines()) == 1
    assert load_identity(key).public_bytes == read_public_key(pub)
    assert main(["keygen", "--out", str(tmp_path / "k")]) == 1
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["keygen", "--out", str(tmp_path / "k"), "--force"]) == 0
    assert capsys.readouterr().out.strip() != fp


def test_an_allowed_client_gets_the_unencrypted_foundations_output(tiny_llama, tiny_split, locked_server, tmp_path):
    """fp32 over the encrypted, mutually authenticated channel = transformers' greedy decoding of the full
    model (which is what the plaintext foundation produced, tests/edge/test_split_generation.py)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    prompt = [5, 6, 7, 8]
    with Edge(
        tiny_split / "edge",
        locked_server.url,
        EdgeConfig(wire_dtype="fp32", identity=tmp_path / "alice.key", cloud_key=tmp_path / "cloud.pub"),
    ) as edge:
        result = edge.generate(prompt, max_new_tokens=24, stop_at_eos=False)
    assert result.token_ids == hf_greedy(hf, prompt, 24)


def test_an_unlisted_client_fails_with_a_clear_message(tiny_split, locked_server, tmp_path, keys):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitlm",
            "generate",
            "--edge",
            str(tiny_split / "edge"),
            "--cloud",
            locked_server.url,
            "--prompt",
            "hi",
            "--identity",
            str(tmp_path / "mallory.key"),
            "--cloud-key",
            str(tmp_path / "cloud.pub"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "UNKNOWN_CLIENT" in proc.stderr and "not on this cloud's list of allowed clients" in proc.stderr
    assert keys["mallory"] in proc.stderr


def test_a_wrong_cloud_key_fails_with_a_clear_message(tiny_split, locked_server, tmp_path, keys, capsys):
    for wrong in (str(tmp_path / "mallory.pub"), keys["mallory"]):
        code = main(
            [
                "generate",
                "--edge",
                str(tiny_split / "edge"),
                "--cloud",
                locked_server.url,
                "--prompt",
                "hi",
                "--identity",
                str(tmp_path / "alice.key"),
                "--cloud-key",
                wrong,
            ]
        )
        err = capsys.readouterr().err
        assert code == 1 and f"presented key {keys['cloud']}, but --cloud-key pins {keys['mallory']}" in err
    code = main(
        [
            "generate",
            "--edge",
            str(tiny_split / "edge"),
            "--cloud",
            locked_server.url,
            "--prompt",
            "hi",
            "--cloud-key",
            "SHA256:short",
        ]
    )
    assert code == 1 and "malformed fingerprint" in capsys.readouterr().err


def test_trust_on_first_use_then_a_changed_key_is_refused(tiny_split, tmp_path, capsys, keys):
    hosts = tmp_path / "known_hosts"
    args = ["generate", "--edge", str(tiny_split / "edge"), "--prompt", "hi", "--known-hosts", str(hosts)]
    with BackgroundServer(tiny_split / "cloud", identity=tmp_path / "cloud.key") as server:
        port = server.server.port
        assert main([*args, "--cloud", server.url]) == 1  # connects (and records the key); the tiny model has
        assert "no tokenizer" in capsys.readouterr().err  # no tokenizer, so generating text fails afterwards
        assert hosts.read_text() == f"127.0.0.1:{port} {keys['cloud']}\n"
    with BackgroundServer(tiny_split / "cloud", identity=tmp_path / "mallory.key", port=port) as server:
        assert main([*args, "--cloud", server.url]) == 1
        err = capsys.readouterr().err
        assert f"{hosts} line 1 records {keys['cloud']}; refusing to connect" in err


def self_signed_cert(tmp_path):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "tls.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return tmp_path / "tls.crt", tmp_path / "tls.key"


def test_serve_cloud_with_identity_clients_and_tls(tiny_split, tmp_path, keys, capsys):
    cert, key = self_signed_cert(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitlm",
            "serve-cloud",
            "--shard",
            str(tiny_split / "cloud"),
            "--port",
            "0",
            "--identity",
            str(tmp_path / "cloud.key"),
            "--clients",
            str(tmp_path / "clients"),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        log = []
        while not any("allowed client" in line for line in log):
            line = proc.stderr.readline()
            assert line, "".join(log)
            log.append(line)
        text = "".join(log)
        url = re.search(r"on (wss://127\.0\.0\.1:\d+)", text).group(1)
        assert f"cloud identity {keys['cloud']}" in text and "1 allowed client key(s)" in text
        edge_args = [
            "generate",
            "--edge",
            str(tiny_split / "edge"),
            "--cloud",
            url,
            "--prompt",
            "hi",
            "--cloud-key",
            keys["cloud"],
            "--tls-ca",
            str(cert),
        ]
        assert main([*edge_args, "--identity", str(tmp_path / "mallory.key")]) == 1
        assert "UNKNOWN_CLIENT" in capsys.readouterr().err
        assert main([*edge_args[:-2], "--identity", str(tmp_path / "alice.key")]) == 1  # no --tls-ca
        assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
        with Edge(
            tiny_split / "edge",
            url,
            EdgeConfig(wire_dtype="fp32", identity=tmp_path / "alice.key", cloud_key=keys["cloud"], tls_ca=cert),
        ) as edge:
            assert len(edge.generate([5, 6, 7], max_new_tokens=4, stop_at_eos=False).token_ids) == 4
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_cloud_option_mistakes(tiny_split, tmp_path, capsys):
    shard = str(tiny_split / "cloud")
    assert main(["serve-cloud", "--shard", shard, "--identity", str(tmp_path / "none.key")]) == 1
    assert "identity file not found" in capsys.readouterr().err
    assert main(["serve-cloud", "--shard", shard, "--clients", str(tmp_path / "none")]) == 1
    assert "clients file not found" in capsys.readouterr().err
    assert main(["serve-cloud", "--shard", shard, "--tls-cert", str(tmp_path / "c.pem")]) == 1
    assert "needs both a certificate" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_json_fp32_with_keys_matches_transformers(bundled_split, bundled_hf, tmp_path, capsys):
    hf, tok = bundled_hf
    for name in ("cloud", "alice"):
        keygen(capsys, tmp_path / name)
    (tmp_path / "clients").write_text((tmp_path / "alice.pub").read_text())
    with BackgroundServer(
        bundled_split / "cloud", identity=tmp_path / "cloud.key", allowed_clients=tmp_path / "clients"
    ) as server:
        code = main(
            [
                "generate",
                "--edge",
                str(bundled_split / "edge"),
                "--cloud",
                server.url,
                "--prompt",
                "The sky is",
                "--max-new-tokens",
                "16",
                "--json",
                "--wire-dtype",
                "fp32",
                "--no-chat",
                "--identity",
                str(tmp_path / "alice.key"),
                "--cloud-key",
                str(tmp_path / "cloud.pub"),
            ]
        )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(hf, tok("The sky is").input_ids, 16)[: len(out["token_ids"])]
    assert len(out["token_ids"]) == 16 or out["finish_reason"] == "stop"
