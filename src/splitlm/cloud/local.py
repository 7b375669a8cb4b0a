"""A cloud server in a local subprocess (`splitlm serve-cloud --threads 1`), for the demo and the bench."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from splitlm import SplitLMError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 120.0, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            last = log.read_text().strip().splitlines()[-1:] if log is not None and log.is_file() else []
            raise SplitLMError("the cloud server exited during start-up" + (f": {last[0]}" if last else ""))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SplitLMError("the cloud server did not become healthy in time")


class LocalCloud:
    """A `splitlm serve-cloud --threads 1` subprocess on a fixed loopback port (on `device`, computing in
    `dtype`, with `extra_args`), which can be killed like a crash (SIGKILL) and started again on its port.
    Its stderr goes to `log`."""

    def __init__(
        self,
        shard_dir: str | Path,
        log: Path,
        device: str = "auto",
        dtype: str = "auto",
        extra_args: list[str] = (),
        timeout_s: float = 120.0,
    ):
        self.port = free_port()
        self.log, self.timeout_s = log, timeout_s
        self.argv = [
            sys.executable,
            "-m",
            "splitlm",
            "serve-cloud",
            "--shard",
            str(shard_dir),
            "--port",
            str(self.port),
            "--threads",
            "1",
            "--device",
            device,
            "--dtype",
            dtype,
            *extra_args,
        ]
        self.proc: subprocess.Popen | None = None
        self.kills = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> None:
        """Start the server process (unless it runs), without waiting for it to serve."""
        if not self.running:
            with open(self.log, "ab") as err:
                self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=err)

    def start(self) -> None:
        """Start the server (unless it runs) and wait until it answers `/healthz`."""
        self.launch()
        wait_healthy(self.port, self.proc, self.timeout_s, log=self.log)

    def kill(self) -> None:
        """SIGKILL the server: no close frames, no goodbye, as when its machine fails."""
        if self.running:
            self.proc.kill()
            self.proc.wait()
            self.kills += 1

    def stop(self) -> None:
        if self.running:
            stop(self.proc)


@contextlib.contextmanager
def cloud_process(
    shard_dir: str | Path,
    device: str = "auto",
    dtype: str = "auto",
    extra_args: list[str] = (),
    timeout_s: float = 120.0,
) -> Iterator[int]:
    """Serve `shard_dir` from a `splitlm serve-cloud --threads 1` subprocess on loopback (on `device`,
    computing in `dtype`, with `extra_args`, e.g. ``["--max-batch", "1"]``); yields its port.

    The server uses the default cloud identity of the config dir (pin it with
    `default_identity("cloud").fingerprint`)."""
    with tempfile.TemporaryDirectory(prefix="splitlm-cloud-") as tmp:
        cloud = LocalCloud(shard_dir, Path(tmp) / "stderr.log", device, dtype, extra_args, timeout_s)
        try:
            cloud.start()
            yield cloud.port
        finally:
            cloud.stop()


def health(port: int) -> dict[str, str]:
    """The fields of a cloud's `/healthz` answer (`ok FINGERPRINT device=... dtype=...`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        status, fingerprint, *fields = r.read().decode().split()
    return {"status": status, "fingerprint": fingerprint, **dict(f.split("=", 1) for f in fields if "=" in f)}


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
