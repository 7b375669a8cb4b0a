"""`splitlm serve-cloud --ray` as a user runs it: a Ray instance of its own, and attached by address
to a running local cluster (`ray start --head`); generating against each (`splitlm generate`, then
an edge in this process) gives the tokens of the single-process cloud. The cluster is this test's own `ray start
--head --block` process,
stopped by SIGTERM (which ends the processes it started), never `ray stop` (which would end every
Ray instance on the machine)."""

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from splitlm.cloud.local import free_port, wait_healthy
from splitlm.cloud.server import BackgroundServer
from splitlm.edge import Edge, EdgeConfig

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

RAY = Path(sys.executable).with_name("ray")
PROMPT = "hello, hello"
MAX_NEW = 12


@pytest.fixture(scope="module")
def ray_env() -> dict[str, str]:
    """Token authentication (Ray's default for clusters) with a token of this test's own, in the
    environment only: nothing is written to ~/.ray."""
    return {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }  # no drain wait at SIGTERM


@pytest.fixture(scope="module")
def expected(tiny_chat_split) -> list[int]:
    """The single-process cloud's greedy tokens."""
    with (
        BackgroundServer(tiny_chat_split / "cloud") as server,
        Edge(tiny_chat_split / "edge", server.url, EdgeConfig(wire_dtype="fp32")) as edge,
    ):
        return edge.generate(PROMPT, MAX_NEW, stop_at_eos=False).token_ids


@contextlib.contextmanager
def serve_cloud(shard: Path, ray_arg: list[str], env: dict, log: Path):
    port = free_port()
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "splitlm",
                "serve-cloud",
                "--shard",
                str(shard),
                "--port",
                str(port),
                "--threads",
                "1",
                *ray_arg,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        try:
            wait_healthy(port, proc, timeout_s=180, log=log)
        except Exception:
            pytest.fail(f"serve-cloud {' '.join(ray_arg)} did not start:\n{log.read_text()[-3000:]}")
        yield f"ws://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def generate(split: Path, url: str, env: dict) -> list[int]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitlm",
            "generate",
            "--edge",
            str(split / "edge"),
            "--cloud",
            url,
            "--prompt",
            PROMPT,
            "--no-chat",
            "--max-new-tokens",
            str(MAX_NEW),
            "--ignore-eos",
            "--wire-dtype",
            "fp32",
            "--threads",
            "1",
            "--json",
            "-q",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["token_ids"]


def test_serve_cloud_ray_starts_its_own_instance(tiny_chat_split, expected, ray_env, tmp_path):
    with serve_cloud(tiny_chat_split / "cloud", ["--ray"], ray_env, tmp_path / "cloud.txt") as url:
        assert generate(tiny_chat_split, url, ray_env) == expected


@contextlib.contextmanager
def ray_cluster(env: dict) -> str:
    """A one-node cluster of this test's own (`ray start --head --block`); yields its address."""
    if not RAY.is_file():
        pytest.skip("no `ray` command next to this Python")
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
    port = free_port()
    proc = subprocess.Popen(
        [
            str(RAY),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--object-store-memory=100000000",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (Path(temp) / "ray_current_cluster").is_file():  # written once the head is up
            if proc.poll() is not None:
                pytest.skip(f"ray start failed here: {proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.skip("ray start did not come up in 90 s")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)  # the head ends the processes it started (actors included)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(temp, ignore_errors=True)


def test_serve_cloud_ray_attaches_to_a_running_cluster_by_address(tiny_chat_split, expected, ray_env, tmp_path):
    with (
        ray_cluster(ray_env) as address,
        serve_cloud(tiny_chat_split / "cloud", ["--ray", address], ray_env, tmp_path / "cloud.txt") as url,
        Edge(tiny_chat_split / "edge", url, EdgeConfig(wire_dtype="fp32")) as edge,
    ):  # no second CLI start-up
        assert edge.generate(PROMPT, MAX_NEW, stop_at_eos=False).token_ids == expected
