"""A cloud server in a local subprocess (`splitlm serve-cloud --threads 1`), for the demo and the bench."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from splitlm import SplitLMError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SplitLMError("the cloud server exited during start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SplitLMError("the cloud server did not become healthy in time")


@contextlib.contextmanager
def cloud_process(shard_dir: str | Path) -> Iterator[int]:
    """Serve `shard_dir` from a `splitlm serve-cloud --threads 1` subprocess on loopback; yields its port.

    The server uses the default cloud identity of the config dir (pin it with
    `default_identity("cloud").fingerprint`)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitlm", "serve-cloud", "--shard", str(shard_dir),
                             "--port", str(port), "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, proc)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
