"""Preemption instead of refusal: a full KV budget frees the least recently active idle session (never
one with a FORWARD in flight), CAPACITY only when every session is mid-request, idle sessions are freed
after the idle timeout, and real edges replay into a new session so that their output never changes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import splitlm.cloud.preemption as preemption
import splitlm.cloud.runner as runner_module
from conftest import scrape_metrics
from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits
from splitlm.decoding.modes import SpecConfig
from splitlm.edge import Edge, EdgeConfig
from splitlm.model.paged_kv import BLOCK_SIZE
from splitlm.model.shards import Manifest
from splitlm.transport.client import CloudClient, CloudError
from splitlm.transport.errors import ErrorCode
from splitlm.transport.messages import Control, Forward, Open, PolicyChange

BLOCK_BYTES = BLOCK_SIZE * 512  # one block of the tiny cloud's (paged) cache (tests/cloud/test_budget.py)
SESSION_BYTES = 2 * BLOCK_BYTES  # about what a session of `generate` holds at its end (8 prompt + 20 new tokens)


def send(client: CloudClient, sid: int, rows: int = 4, start: int = 0):
    """A FORWARD sent and not waited for (its reply is taken with `client.receive_forward`)."""
    h = torch.randn(rows, 64)
    request = Forward(h, torch.arange(start, start + rows), control=Control())
    return client.send_forward(sid, request, "fp32", h.numel())


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture()
def gate(monkeypatch):
    """While cleared, holds the cloud's compute thread inside its next pass (FORWARDs stay in flight)."""
    release, run_layers = threading.Event(), runner_module.run_layers
    release.set()

    def held(model, pieces):
        release.wait(20)
        return run_layers(model, pieces)

    monkeypatch.setattr(runner_module, "run_layers", held)
    yield release
    release.set()


def test_a_session_with_a_forward_in_flight_is_never_preempted_and_capacity_when_all_are(tiny_split, gate, monkeypatch):
    monkeypatch.setattr(preemption, "RUNNING_S", 0.0)  # idle once its reply is out: only mid-request protects
    fp = Manifest.read(tiny_split / "edge", "edge").fingerprint
    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(kv_budget_bytes=2 * BLOCK_BYTES)) as server:
        cloud = server.server
        c1, c2, c3 = (CloudClient(server.url, fp) for _ in range(3))  # a connection answers one request at a time
        try:
            a, b = c1.open(Open("fp32")).session, c2.open(Open("fp32")).session
            gate.clear()
            pending_a = send(c1, a)
            wait_for(lambda: sum(cloud.scheduler.load()) == 1, "a's FORWARD to reach the scheduler")
            with pytest.raises(CloudError) as e:  # `a` is mid-request, `b` was just opened and not used yet
                c3.open(Open("fp32"))
            assert e.value.code == ErrorCode.CAPACITY and e.value.recoverable
            gate.set()
            assert c1.receive_forward(pending_a).cache_len == 4
            c2.receive_forward(send(c2, b))
            gate.clear()
            pending_a = send(c1, a, start=4)
            wait_for(lambda: sum(cloud.scheduler.load()) == 1, "a's second FORWARD to reach the scheduler")
            c2.policy(b, PolicyChange())  # `b` is now more recently active than `a`...
            d = c3.open(Open("fp32")).session  # ...but `a` is mid-request: `b` goes
            assert set(cloud.sessions.sessions) == {a, d} and cloud.stats.preemptions == 1
            pending_d = send(c3, d)
            wait_for(lambda: sum(cloud.scheduler.load()) == 2, "d's FORWARD to queue")
            with pytest.raises(CloudError) as e:  # every session mid-request: nothing can be freed
                c2.open(Open("fp32"))
            assert e.value.code == ErrorCode.CAPACITY
            values = scrape_metrics(cloud.scrape().decode())
            assert (
                values["splitlm_cloud_num_requests_running"] == 1 and values["splitlm_cloud_num_requests_waiting"] == 1
            )
            assert values["splitlm_cloud_kv_cache_usage_perc"] == 1.0
            assert values["splitlm_cloud_num_preemptions_total"] == 1
            gate.set()
            assert c1.receive_forward(pending_a).cache_len == 8  # both steps complete, untouched
            assert c3.receive_forward(pending_d).cache_len == 4
            with pytest.raises(CloudError) as e:
                c2.receive_forward(send(c2, b, start=4))
            assert e.value.code == ErrorCode.PREEMPTED
        finally:
            gate.set()
            for c in (c1, c2, c3):
                c.close()


def conversation(split, url: str, pause: float = 0.0) -> tuple[list[list[int]], int]:
    """Two turns of one conversation (with `pause` seconds between them): the answers and the preemptions."""
    with Edge(split / "edge", url, EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32")) as edge:
        chat = edge.conversation(spec=SpecConfig("ngram"))
        first = chat.say("abcabc abc", max_new_tokens=10)
        time.sleep(pause)
        second = chat.say("cab abcabc", max_new_tokens=10)
        chat.close()
    return [first.token_ids, second.token_ids], first.stats.preemptions + second.stats.preemptions


def test_an_idle_session_is_freed_after_the_idle_timeout_and_its_edge_replays(tiny_chat_split):
    with BackgroundServer(tiny_chat_split / "cloud", limits=ServerLimits(idle_timeout_s=0)) as server:
        want, preempted = conversation(tiny_chat_split, server.url)  # 0: sessions never expire
    assert preempted == 0
    with BackgroundServer(tiny_chat_split / "cloud", limits=ServerLimits(idle_timeout_s=0.3)) as server:
        cloud = server.server
        got, preempted = conversation(tiny_chat_split, server.url, pause=1.0)
        assert got == want and preempted >= 1  # (at least) the second turn found its session freed, and replayed
        assert cloud.stats.idle_evictions >= 1 and cloud.stats.replays >= 1
        values = scrape_metrics(cloud.scrape().decode())
        assert values["splitlm_cloud_idle_evictions_total"] >= 1 and values["splitlm_cloud_context_rows_total"] > 0
        wait_for(lambda: not cloud.sessions.sessions, "the last session to be freed")
        assert cloud.sessions.kv_reserved == 0


PROMPTS = [[3 + i, 40 + 7 * i, 9, 100 + i, 17, 3 + i, 40 + 7 * i, 9] for i in range(12)]


def generate(split, url: str, prompt: list[int], start: threading.Barrier | None = None):
    with Edge(split / "edge", url, EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32")) as edge:
        if start is not None:
            start.wait(30)
        return edge.generate(prompt, max_new_tokens=20, stop_at_eos=False, spec=SpecConfig("ngram"))


def test_twelve_edges_on_a_budget_for_four_sessions_all_match_their_solo_runs(tiny_split):
    """12 real edges (greedy, fp32 wire, real encrypted WebSockets) at once on a cloud whose KV budget
    holds 4 sessions: sessions are preempted and replayed, nobody fails, every output is its solo output."""
    # one client key for all 12 (8 sessions per client by default): the budget, not that limit, must bind
    limits = ServerLimits(kv_budget_bytes=4 * SESSION_BYTES, max_sessions_per_client=len(PROMPTS))
    with BackgroundServer(tiny_split / "cloud", limits=limits) as server:
        cloud = server.server
        assert cloud.budget.entries < cloud.model.cfg.max_position_embeddings  # below one full context
        solo = [generate(tiny_split, server.url, p).token_ids for p in PROMPTS]
        assert cloud.stats.preemptions == 0
        start, results, errors = threading.Barrier(len(PROMPTS)), [None] * len(PROMPTS), []

        def run(i: int) -> None:
            try:
                results[i] = generate(tiny_split, server.url, PROMPTS[i], start)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert [r.token_ids for r in results] == solo
        assert cloud.stats.preemptions > 0 and sum(r.stats.preemptions for r in results) > 0
        codes = scrape_metrics(cloud.scrape().decode())
        refused = {k for k, v in codes.items() if k.startswith("splitlm_cloud_errors_total") and v}
        assert refused <= {
            'splitlm_cloud_errors_total{code="PREEMPTED"}',
            'splitlm_cloud_errors_total{code="CAPACITY"}',
        }
        wait_for(lambda: cloud.sessions.kv_reserved == 0, "every session to end with its connection")
