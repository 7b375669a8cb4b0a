"""Faults of the opening: the first cloud of `--cloud a,b` dies while the edge is still opening its
connection or its session (TCP accepted, during the WebSocket upgrade, after HELLO, during OPEN),
through the WAN emulator; the edge goes on to the second cloud and its output equals a solo run.
When no cloud can be reached, one clear error line (the CLI: exit 1, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitlm.bench.wan import WanConfig, WanEmulator
from splitlm.cloud.local import free_port
from splitlm.cloud.server import BackgroundServer
from splitlm.decoding.modes import SpecConfig
from splitlm.edge import Edge, EdgeConfig
from splitlm.transport.client import CloudClient, CloudError

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def clouds(tiny_split):
    """Cloud A (to be cut, behind the emulator) and cloud B, serving the same shard."""
    with BackgroundServer(tiny_split / "cloud") as a, BackgroundServer(tiny_split / "cloud") as b:
        yield a, b


def generate(split, urls: list[str]):
    with Edge(
        split / "edge", urls, EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32", failover_timeout_s=10)
    ) as edge:
        r = edge.generate(PROMPT, max_new_tokens=12, stop_at_eos=False, spec=SpecConfig("ngram"))
        return r, edge.client.url


@pytest.fixture(scope="module")
def opening(tiny_split, clouds):
    """The byte counts (both directions, in order) at which each part of a clean opening ends: the
    upgrade request, its response, HELLO, HELLO_OK, OPEN; and the solo output on cloud B."""
    a, b = clouds
    with WanEmulator(("127.0.0.1", int(a.url.rsplit(":", 1)[1])), WanConfig(rtt_ms=0), capture=True) as wan:
        fp = b.server.manifest.fingerprint
        client = CloudClient(wan.url_for("ws"), fp)
        request = wan.captured_up.index(b"\r\n\r\n") + 4
        response = wan.captured_down.index(b"\r\n\r\n") + 4
        hello = wan.bytes_up
        hello_ok = wan.bytes_up + wan.bytes_down
        client.close()
    ends = {
        "upgrade-request": request,
        "upgrade-response": request + response,
        "hello": response + hello,
        "hello-ok": hello_ok,
    }
    return ends, generate(tiny_split, [b.url])[0].token_ids


# where to cut: a byte count into the opening's traffic (computed from `opening`'s ends)
CUTS = {
    "during-upgrade-request": lambda e: e["upgrade-request"] // 2,
    "during-upgrade-response": lambda e: (e["upgrade-request"] + e["upgrade-response"]) // 2,
    "after-hello": lambda e: (e["hello"] + e["hello-ok"]) // 2,  # HELLO went up; HELLO_OK is cut
}


@pytest.mark.parametrize("moment", list(CUTS))
def test_a_cloud_dying_during_the_opening_hands_over_to_the_next(tiny_split, clouds, opening, moment):
    a, b = clouds
    ends, solo = opening
    with WanEmulator(("127.0.0.1", int(a.url.rsplit(":", 1)[1])), WanConfig(rtt_ms=2)) as wan:
        wan.cut_after(CUTS[moment](ends))
        r, used = generate(tiny_split, [wan.url_for("ws"), b.url])
        assert wan.cuts == 1
    assert r.token_ids == solo and used == b.url and r.stats.failovers == 0


def test_a_cloud_dying_during_open_hands_over_to_the_next(tiny_split, clouds, opening):
    """The connection is up (the edge keeps it in its pool); the link dies while OPEN is in flight."""
    a, b = clouds
    _, solo = opening
    with (
        WanEmulator(("127.0.0.1", int(a.url.rsplit(":", 1)[1])), WanConfig(rtt_ms=2)) as wan,
        Edge(
            tiny_split / "edge",
            [wan.url_for("ws"), b.url],
            EdgeConfig(wire_dtype="fp32", device="cpu", failover_timeout_s=10),
        ) as edge,
    ):
        wan.cut_after(8)  # the next bytes to cross the link are OPEN's
        r = edge.generate(PROMPT, max_new_tokens=12, stop_at_eos=False, spec=SpecConfig("ngram"))
        assert wan.cuts == 1
    assert r.token_ids == solo


def test_a_dead_cloud_behind_an_accepting_proxy_hands_over_to_the_next(tiny_split, clouds, opening):
    """TCP accepted (by the emulator), then closed at once: its cloud is gone (the issue's case: the
    WebSocket library raised ConnectionClosedError from the opening handshake)."""
    _, b = clouds
    _, solo = opening
    with WanEmulator(("127.0.0.1", free_port()), WanConfig(rtt_ms=80)) as dead:
        r, used = generate(tiny_split, [dead.url_for("ws"), b.url])
    assert r.token_ids == solo and used == b.url


def test_a_connection_closed_in_the_upgrade_is_retryable(monkeypatch):
    """websockets raises ConnectionClosedError (not InvalidHandshake) when the peer closes before the
    upgrade request is sent: the client reports a retryable CloudError, never the library's exception."""
    from websockets.exceptions import ConnectionClosedError

    import splitlm.transport.client as client_module

    def closed(*args, **kwargs):
        raise ConnectionClosedError(None, None)

    monkeypatch.setattr(client_module, "connect", closed)
    with pytest.raises(CloudError, match="cannot reach the cloud") as e:
        CloudClient("ws://127.0.0.1:9", "0" * 32)
    assert e.value.retryable


def test_no_cloud_reachable_is_one_line_and_exit_1(tiny_split):
    with WanEmulator(("127.0.0.1", free_port()), WanConfig(rtt_ms=0)) as dead:
        urls = f"{dead.url_for('ws')},ws://127.0.0.1:{free_port()}"
        with pytest.raises(CloudError, match="none of the 2 clouds could be reached"):
            Edge(tiny_split / "edge", urls, EdgeConfig(device="cpu"))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "splitlm",
                "generate",
                "--edge",
                str(tiny_split / "edge"),
                "--cloud",
                urls,
                "--prompt",
                "hi",
                "--device",
                "cpu",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "none of the 2 clouds could be reached" in errors[0], proc.stderr
