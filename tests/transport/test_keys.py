"""Identity key files, fingerprints, the known-hosts file and the allow-list."""

import base64
import hashlib
import os
import stat

import pytest

from splitlm import SplitLMError
from splitlm.transport.keys import (
    AllowedClients,
    KnownHosts,
    config_dir,
    default_identity,
    fingerprint,
    generate_identity,
    host_id,
    is_fingerprint,
    load_identity,
    parse_key_spec,
    parse_public_key,
    read_public_key,
    write_identity,
)


def test_fingerprint_is_ssh_style_sha256_of_the_raw_key():
    pub = bytes(range(32))
    fp = fingerprint(pub)
    assert fp == "SHA256:" + base64.b64encode(hashlib.sha256(pub).digest()).decode().rstrip("=")
    assert len(fp) == 7 + 43 and is_fingerprint(fp)
    assert not is_fingerprint("SHA256:abc") and not is_fingerprint(fp[7:])


def test_key_files_round_trip_with_private_mode(tmp_path):
    ident = generate_identity()
    key, pub = write_identity(tmp_path / "alice", ident, comment="alice@test")
    assert (key.name, pub.name) == ("alice.key", "alice.pub")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    line = pub.read_text()
    assert line.count("\n") == 1 and line.startswith("splitlm-x25519 ") and line.rstrip().endswith("alice@test")
    assert load_identity(key).public_bytes == ident.public_bytes == read_public_key(pub)
    assert parse_public_key(line) == ident.public_bytes
    with pytest.raises(SplitLMError, match="exists"):
        write_identity(tmp_path / "alice", generate_identity())
    write_identity(tmp_path / "alice.key", generate_identity(), force=True)  # a .key suffix names the prefix
    assert load_identity(key).public_bytes != ident.public_bytes


def test_bad_key_files_give_clear_errors(tmp_path):
    with pytest.raises(SplitLMError, match="identity file not found"):
        load_identity(tmp_path / "missing.key")
    _, pub = write_identity(tmp_path / "k", generate_identity())
    with pytest.raises(SplitLMError, match="public half"):
        load_identity(pub)
    (tmp_path / "junk.key").write_text("junk")
    with pytest.raises(SplitLMError, match="not a splitlm private key"):
        load_identity(tmp_path / "junk.key")
    (tmp_path / "bad.pub").write_text("splitlm-x25519 AAAA\n")
    with pytest.raises(SplitLMError, match="bytes instead of 32"):
        read_public_key(tmp_path / "bad.pub")


def test_key_specs_for_pinning(tmp_path):
    ident = generate_identity()
    _, pub = write_identity(tmp_path / "cloud", ident)
    fp = ident.fingerprint
    assert parse_key_spec(str(pub)) == parse_key_spec(fp) == parse_key_spec(ident.public_bytes) == fp
    assert parse_key_spec(ident.public_line("x")) == fp
    with pytest.raises(SplitLMError, match="malformed fingerprint"):
        parse_key_spec("SHA256:nope")
    with pytest.raises(SplitLMError, match="neither a public key file nor"):
        parse_key_spec(str(tmp_path / "nothing.pub"))


def test_default_identity_lives_in_the_config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITLM_CONFIG", str(tmp_path / "cfg"))
    assert config_dir() == tmp_path / "cfg"
    a = default_identity("client")
    assert (tmp_path / "cfg" / "client.key").is_file() and (tmp_path / "cfg" / "client.pub").is_file()
    assert default_identity("client").public_bytes == a.public_bytes  # kept, not regenerated
    assert default_identity("cloud").public_bytes != a.public_bytes
    assert stat.S_IMODE((tmp_path / "cfg").stat().st_mode) == 0o700
    monkeypatch.delenv("SPLITLM_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert config_dir() == tmp_path / "xdg" / "splitlm"


def test_the_session_never_uses_the_real_home():
    home = os.path.realpath(os.path.expanduser("~"))
    assert os.environ["SPLITLM_CONFIG"] and not os.path.realpath(config_dir()).startswith(home + os.sep + ".config")


def test_host_ids():
    assert host_id("ws://Example.org:8765/x") == "example.org:8765"
    assert host_id("wss://example.org") == "example.org:443"
    assert host_id("ws://[::1]:9000") == "[::1]:9000"


def test_known_hosts_file_is_plain_and_editable(tmp_path):
    hosts = KnownHosts(tmp_path / "known_hosts")
    assert hosts.lookup("h:1") is None
    hosts.add("h:1", "SHA256:" + "A" * 43)
    hosts.add("g:2", "SHA256:" + "B" * 43)
    text = (tmp_path / "known_hosts").read_text()
    assert text == f"h:1 SHA256:{'A' * 43}\ng:2 SHA256:{'B' * 43}\n"
    (tmp_path / "known_hosts").write_text("# my hosts\n\n" + text.splitlines()[1] + "  # edited by hand\n")
    assert hosts.lookup("h:1") is None and hosts.lookup("G:2") == (3, "SHA256:" + "B" * 43)


def test_allowed_clients_file(tmp_path):
    a, b, c = generate_identity(), generate_identity(), generate_identity()
    path = tmp_path / "clients"
    path.write_text(f"# team\n{a.public_line('alice')}\n\n{b.fingerprint}  # bob, by fingerprint\n")
    allowed = AllowedClients(path)
    assert a.public_bytes in allowed and b.public_bytes in allowed and c.public_bytes not in allowed
    assert len(allowed) == 2
    path.write_text(c.public_line() + "\n")  # revoke a and b, add c: picked up without a restart
    os.utime(path, ns=(1, 1))
    assert c.public_bytes in allowed and a.public_bytes not in allowed
    path.write_text("splitlm-x25519 garbage\n")
    os.utime(path, ns=(2, 2))
    assert c.public_bytes in allowed  # a broken edit keeps the last good list
    with pytest.raises(SplitLMError, match="line 1"):
        AllowedClients(path)
    with pytest.raises(SplitLMError, match="not found"):
        AllowedClients(tmp_path / "missing")
    assert a.public_bytes in AllowedClients([a.public_bytes, b.fingerprint])
