"""Static X25519 identities, their files and fingerprints, the edge's known-hosts file, the cloud's allow-list.

Files (all plain text; see docs/protocol.md, "Keys and fingerprints"):

    PREFIX.key      the private key, PEM PKCS#8 ("-----BEGIN PRIVATE KEY-----"), mode 0600
    PREFIX.pub      one line: ``splitlm-x25519 <base64 of the 32 raw public-key bytes> [comment]``
    known_hosts     the edge's trust-on-first-use record, one ``HOST:PORT SHA256:...`` per line
    clients file    the cloud's allow-list, one public-key line (or a ``SHA256:`` fingerprint) per line

A fingerprint is ``SHA256:`` + unpadded standard base64 of SHA-256(raw 32-byte public key), as
OpenSSH writes them (OpenSSH hashes its own key blob, we hash the raw key).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from splitlm import SplitLMError

log = logging.getLogger(__name__)

KEY_TYPE = "splitlm-x25519"
PUBLIC_KEY_SIZE = 32
FINGERPRINT_PREFIX = "SHA256:"
FINGERPRINT_LENGTH = len(FINGERPRINT_PREFIX) + 43  # 32 bytes -> 43 base64 characters without padding


def config_dir() -> Path:
    """Where splitlm keeps identities and known_hosts: $SPLITLM_CONFIG, else $XDG_CONFIG_HOME/splitlm,
    else ~/.config/splitlm."""
    if env := os.environ.get("SPLITLM_CONFIG"):
        return Path(env)
    if xdg := os.environ.get("XDG_CONFIG_HOME"):
        return Path(xdg) / "splitlm"
    return Path.home() / ".config" / "splitlm"


def fingerprint(public_key: bytes) -> str:
    """``SHA256:<base64>`` of a raw 32-byte X25519 public key."""
    return FINGERPRINT_PREFIX + base64.b64encode(hashlib.sha256(public_key).digest()).decode().rstrip("=")


def is_fingerprint(text: str) -> bool:
    if not text.startswith(FINGERPRINT_PREFIX) or len(text) != FINGERPRINT_LENGTH:
        return False
    try:
        return len(base64.b64decode(text[len(FINGERPRINT_PREFIX) :] + "=", validate=True)) == 32
    except (binascii.Error, ValueError):
        return False


@dataclass(frozen=True)
class Identity:
    """A static X25519 key pair (the cloud's host key, or a client's key)."""

    private_key: X25519PrivateKey
    path: Path | None = None  # the .key file it came from, if any

    @property
    def public_bytes(self) -> bytes:
        return self.private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_bytes)

    def public_line(self, comment: str = "") -> str:
        return format_public_key(self.public_bytes, comment)

    def private_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def generate_identity() -> Identity:
    return Identity(X25519PrivateKey.generate())


def format_public_key(public_key: bytes, comment: str = "") -> str:
    line = f"{KEY_TYPE} {base64.b64encode(public_key).decode()}"
    return f"{line} {comment}" if comment else line


def parse_public_key(line: str) -> bytes:
    """Raw public key from a ``splitlm-x25519 BASE64 [comment]`` line (or the bare base64)."""
    parts = line.split()
    if parts and parts[0] == KEY_TYPE:
        parts = parts[1:]
    if not parts:
        raise ValueError("empty public key")
    try:
        raw = base64.b64decode(parts[0], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"not a {KEY_TYPE} public key: bad base64") from None
    if len(raw) != PUBLIC_KEY_SIZE:
        raise ValueError(f"not a {KEY_TYPE} public key: {len(raw)} bytes instead of {PUBLIC_KEY_SIZE}")
    return raw


def read_public_key(path: str | Path) -> bytes:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SplitLMError(f"public key file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SplitLMError(f"cannot read public key file {path}: {e}") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if len(lines) != 1:
        raise SplitLMError(f"{path} must hold exactly one public key line, found {len(lines)}")
    try:
        return parse_public_key(lines[0])
    except ValueError as e:
        raise SplitLMError(f"{path}: {e}") from None


def _write_private(path: Path, data: bytes, force: bool) -> None:
    """Write a 0600 file atomically; without `force` fail if it exists (also against a concurrent writer)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic; FileExistsError if someone was first
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def key_paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    if prefix.endswith(".key") or prefix.endswith(".pub"):
        prefix = prefix[:-4]
    return Path(prefix + ".key"), Path(prefix + ".pub")


def write_identity(
    prefix: str | Path, identity: Identity, comment: str | None = None, force: bool = False
) -> tuple[Path, Path]:
    """Write PREFIX.key (mode 0600) and PREFIX.pub; refuse to overwrite unless `force`."""
    key_path, pub_path = key_paths(prefix)
    if not key_path.parent.is_dir():
        raise SplitLMError(f"directory not found: {key_path.parent}")
    if not force:
        for p in (key_path, pub_path):
            if p.exists():
                raise SplitLMError(f"{p} exists; pass --force to overwrite it (the old key is lost)")
    if comment is None:
        comment = f"{key_path.stem}@{socket.gethostname()}"
    try:
        _write_private(key_path, identity.private_pem(), force)
    except FileExistsError:
        raise SplitLMError(f"{key_path} exists; pass --force to overwrite it") from None
    pub_path.write_text(identity.public_line(comment) + "\n")
    return key_path, pub_path


def load_identity(path: str | Path) -> Identity:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SplitLMError(f"identity file not found: {path} (create one with `splitlm keygen --out PREFIX`)") from None
    except OSError as e:
        raise SplitLMError(f"cannot read identity file {path}: {e.strerror or e}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        hint = " (that is the public half; pass the .key file)" if data.startswith(KEY_TYPE.encode()) else ""
        raise SplitLMError(f"{path} is not a splitlm private key{hint}") from None
    if not isinstance(key, X25519PrivateKey):
        raise SplitLMError(f"{path} holds a {type(key).__name__}, not an X25519 private key")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("private key %s is accessible by others (mode %o); chmod 600 it", path, stat.S_IMODE(mode))
    return Identity(key, path)


def default_identity(role: str) -> Identity:
    """The identity kept in the config dir (``cloud.key`` or ``client.key``), created on first use."""
    directory = config_dir()
    key_path, _ = key_paths(directory / role)
    if not key_path.exists():
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            write_identity(directory / role, generate_identity(), comment=f"{role}@{socket.gethostname()}")
            log.warning("generated a new %s identity %s", role, key_path)
        except SplitLMError:
            pass  # another process created it at the same moment: use theirs
    return load_identity(key_path)


def resolve_identity(identity: Identity | str | Path | None, role: str) -> Identity:
    if identity is None:
        return default_identity(role)
    if isinstance(identity, Identity):
        return identity
    return load_identity(identity)


def parse_key_spec(spec: str | bytes) -> str:
    """A pinned key as given by the user -> its fingerprint.

    Accepts raw 32 public-key bytes, a ``SHA256:...`` fingerprint, a .pub file, or a public-key line."""
    if isinstance(spec, bytes | bytearray):
        if len(spec) != PUBLIC_KEY_SIZE:
            raise SplitLMError(f"a raw public key has {PUBLIC_KEY_SIZE} bytes, got {len(spec)}")
        return fingerprint(bytes(spec))
    spec = str(spec).strip()
    if spec.startswith(FINGERPRINT_PREFIX):
        if not is_fingerprint(spec):
            raise SplitLMError(f"malformed fingerprint {spec!r} (expected SHA256: and 43 base64 characters)")
        return spec
    if spec.startswith(KEY_TYPE + " "):
        try:
            return fingerprint(parse_public_key(spec))
        except ValueError as e:
            raise SplitLMError(str(e)) from None
    path = Path(spec)
    if path.is_file():
        return fingerprint(read_public_key(path))
    raise SplitLMError(f"cloud key {spec!r} is neither a public key file nor a SHA256: fingerprint")


# -- the edge's known hosts --------------------------------------------------------------------------------


def host_id(url: str) -> str:
    """``HOST:PORT`` of a ws:// or wss:// URL (the key of a known_hosts line)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    try:
        port = parts.port or (443 if parts.scheme == "wss" else 80)
    except ValueError:
        port = 0
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class KnownHosts:
    """``HOST:PORT FINGERPRINT`` lines; ``#`` starts a comment. The user may edit the file freely."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else config_dir() / "known_hosts"

    def entries(self) -> list[tuple[int, str, str]]:
        """(line number, host, fingerprint) of every well-formed line."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as e:
            raise SplitLMError(f"cannot read known hosts file {self.path}: {e}") from None
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if len(fields) >= 2:
                out.append((n, fields[0].lower(), fields[1]))
        return out

    def lookup(self, host: str) -> tuple[int, str] | None:
        """(line number, fingerprint) recorded for `host`, if any."""
        for n, h, fp in self.entries():
            if h == host.lower():
                return n, fp
        return None

    def add(self, host: str, fp: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.path, "a") as f:  # one short append: atomic enough between processes
            f.write(f"{host} {fp}\n")


# -- the cloud's allow-list ------------------------------------------------------------------------------


class AllowedClients:
    """The clients allowed to connect: public-key lines or fingerprints, one per line.

    A file is re-read whenever its modification time changes, so a key can be added or revoked
    without restarting the server (sessions already open are not affected)."""

    def __init__(self, source: str | Path | list[str | bytes]):
        self.path: Path | None = None
        self._mtime: float | None = None
        self.fingerprints: set[str] = set()
        if isinstance(source, list | tuple | set | frozenset):
            self.fingerprints = {self._entry(x, f"entry {i + 1}") for i, x in enumerate(source)}
        else:
            self.path = Path(source)
            self._load()

    @staticmethod
    def _entry(item: str | bytes, where: str) -> str:
        if isinstance(item, bytes | bytearray):
            if len(item) != PUBLIC_KEY_SIZE:
                raise SplitLMError(f"{where}: a raw public key has {PUBLIC_KEY_SIZE} bytes")
            return fingerprint(bytes(item))
        item = item.strip()
        if item.startswith(FINGERPRINT_PREFIX):
            if not is_fingerprint(item.split()[0]):
                raise SplitLMError(f"{where}: malformed fingerprint")
            return item.split()[0]
        try:
            return fingerprint(parse_public_key(item))
        except ValueError as e:
            raise SplitLMError(f"{where}: {e}") from None

    def _load(self) -> None:
        assert self.path is not None
        try:
            mtime = self.path.stat().st_mtime_ns
            text = self.path.read_text()
        except FileNotFoundError:
            raise SplitLMError(f"clients file not found: {self.path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise SplitLMError(f"cannot read clients file {self.path}: {e}") from None
        fps = set()
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                fps.add(self._entry(line, f"{self.path} line {n}"))
        self.fingerprints, self._mtime = fps, mtime

    def refresh(self) -> None:
        if self.path is None:
            return
        try:
            if self.path.stat().st_mtime_ns != self._mtime:
                self._load()
                log.info("reloaded %s: %d allowed client(s)", self.path, len(self.fingerprints))
        except (OSError, SplitLMError) as e:  # keep the last good list
            log.warning("cannot reload the clients file: %s", e)

    def __contains__(self, public_key: bytes) -> bool:
        self.refresh()
        return fingerprint(public_key) in self.fingerprints

    def __len__(self) -> int:
        return len(self.fingerprints)
