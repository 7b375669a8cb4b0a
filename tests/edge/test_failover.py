"""Failover with replay: the cloud server process is SIGKILLed mid-request (during the prefill, during
a speculative step, with a pipelined step in flight) and the edge carries on on a second cloud of
its list, or on the same cloud restarted on its port; the output equals an undisturbed run (greedy
fp32 and seeded sampling) for `generate`, a `Conversation` and the streamed OpenAI API."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

import splitlm.edge.replay as replay_module
from splitlm.cloud.local import LocalCloud
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.sampling import SamplingConfig
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.link import CloudLink

PROMPT = "<|user|>abcabcabcabc abcabc\n<|assistant|>"
SEEDED = SamplingConfig(temperature=0.9, seed=7)
NGRAM = SpecConfig("ngram", max_nodes=6)
PIPELINED = SpecConfig("ngram", max_nodes=6, pipeline=True)


class Clouds:
    """`splitlm serve-cloud` subprocesses of one shard (`LocalCloud`s), each on its own port, to kill and restart."""

    def __init__(self, shard, n: int, log_dir):
        self.clouds = [LocalCloud(shard, log_dir / f"cloud{i}.log", "cpu", "fp32", timeout_s=60) for i in range(n)]
        self.ports = [c.port for c in self.clouds]

    @property
    def kills(self) -> int:
        return sum(c.kills for c in self.clouds)

    def url(self, i: int) -> str:
        return f"ws://127.0.0.1:{self.ports[i]}"

    def start(self, i: int) -> None:
        self.clouds[i].launch()

    def up(self) -> None:
        """Every cloud serving (restart the killed ones)."""
        for cloud in self.clouds:
            cloud.start()

    def index(self, url: str) -> int:
        return self.ports.index(int(url.rsplit(":", 1)[1]))

    def freeze(self, url: str) -> None:
        os.kill(self.clouds[self.index(url)].proc.pid, signal.SIGSTOP)  # it answers nothing from now on

    def kill(self, url: str) -> None:
        self.clouds[self.index(url)].kill()

    def terminate(self, url: str) -> None:
        self.clouds[self.index(url)].proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        for cloud in self.clouds:
            if cloud.running:
                cloud.proc.kill()
                cloud.proc.wait()


@pytest.fixture(scope="module")
def clouds(tiny_chat_split, tmp_path_factory):
    c = Clouds(tiny_chat_split / "cloud", 2, tmp_path_factory.mktemp("clouds"))
    try:
        c.up()
        yield c
    finally:
        c.close()


# where to kill: called after a block is sent, with the session's cloud side (`CloudLink`: its stats and the
# blocks in flight) and the block
POINTS = {
    "prefill": lambda s, f: s.stats.round_trips == 0,  # the first forward of a request
    "spec": lambda s, f: s.stats.round_trips >= 2 and len(f.ids) > 1,  # a drafted tree is being verified
    "pipelined": lambda s, f: len(s.flights) == 2,  # a second step sent while the first is in flight
}


@pytest.fixture(autouse=True)
def always_bet(monkeypatch):
    """Pipelined steps bet whenever they can (at loopback latency a bet would rarely pay)."""
    from splitlm.decoding import pipeline

    monkeypatch.setattr(pipeline.PipelinedFlow, "pays", lambda self, p, nodes: True)  # what `always_bet` does


def arm(monkeypatch, clouds: Clouds, point: str, mode: str = "kill") -> list:
    """SIGKILL the cloud a session talks to while the first block matching `point` is unanswered
    (the cloud is frozen before the block goes up, so it cannot have answered it), and start it
    again on its port. `mode` "term": SIGTERM it right after the block went up instead; "freeze":
    only freeze it (a half-open link). Returns a list that records the fault."""
    fired: list[dict] = []
    transmit, replay = CloudLink.transmit, replay_module.replay

    def faulty_transmit(self, f, c):
        hit = not fired and POINTS[point](self, f)
        if hit and mode != "term":
            clouds.freeze(self.client.url)
        transmit(self, f, c)
        if hit:
            fired.append({"url": self.client.url, "tokens": len(f.ids), "in_flight": len(self.flights)})
            if mode == "term":
                clouds.terminate(self.client.url)
            elif mode == "kill":
                clouds.kill(self.client.url)
                clouds.start(clouds.index(self.client.url))  # the same cloud, back on its port in a moment

    def counting_replay(self):
        fired[-1]["owed"] = sum(not f.void for f in self.flights)
        replay(self)

    monkeypatch.setattr(CloudLink, "transmit", faulty_transmit)
    monkeypatch.setattr(replay_module, "replay", counting_replay)
    return fired


def edge_for(split, urls: list[str]) -> Edge:
    return Edge(split / "edge", urls, EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32", failover_timeout_s=30))


REFERENCES: dict = {}


def undisturbed(split, urls, spec, sampling) -> list[int]:
    """The output of an undisturbed run (the same on every cloud of the shard; computed once per case)."""
    key = (repr(spec), repr(sampling))
    if key not in REFERENCES:
        REFERENCES[key] = run_generate(split, urls, spec, sampling)[0]
    return REFERENCES[key]


def run_generate(split, urls, spec, sampling):
    with edge_for(split, urls) as edge:
        r = edge.generate(PROMPT, max_new_tokens=24, stop_at_eos=False, spec=spec, sampling=sampling)
    return r.token_ids, r.stats


CASES = [("prefill", NGRAM), ("spec", NGRAM), ("pipelined", PIPELINED)]


@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("point,spec", CASES, ids=[c[0] for c in CASES])
def test_generate_fails_over_to_the_next_cloud(tiny_chat_split, clouds, monkeypatch, point, spec, sampling):
    clouds.up()
    urls = [clouds.url(0), clouds.url(1)]
    want = undisturbed(tiny_chat_split, urls, spec, sampling)
    fired = arm(monkeypatch, clouds, point)
    got, stats = run_generate(tiny_chat_split, urls, spec, sampling)
    assert fired and fired[0]["owed"] >= 1, "the fault was not injected where the test meant it"
    if point == "pipelined":
        assert fired[0]["in_flight"] == 2
    assert got == want
    assert stats.failovers == 1 and stats.failover_s > 0


@pytest.mark.parametrize(
    "point,spec,sampling",
    [("spec", NGRAM, None), ("pipelined", PIPELINED, SEEDED)],
    ids=["spec-greedy", "pipelined-seeded"],
)
def test_generate_waits_for_the_same_cloud_to_restart(tiny_chat_split, clouds, monkeypatch, point, spec, sampling):
    clouds.up()
    urls = [clouds.url(0)]
    want = undisturbed(tiny_chat_split, urls, spec, sampling)
    fired = arm(monkeypatch, clouds, point)
    got, stats = run_generate(tiny_chat_split, urls, spec, sampling)
    assert fired and got == want
    assert stats.failovers == 1


def test_sigterm_makes_the_cloud_tell_its_edges_to_fail_over(tiny_chat_split, clouds, monkeypatch, caplog):
    """SIGTERM: the cloud finishes the step it computes, sends GOING_AWAY and exits 0; the edge fails
    over at once (no timeout) and the output is unchanged."""
    clouds.up()
    urls = [clouds.url(0), clouds.url(1)]
    want = undisturbed(tiny_chat_split, urls, NGRAM, None)
    fired = arm(monkeypatch, clouds, "spec", mode="term")
    got, stats = run_generate(tiny_chat_split, urls, NGRAM, None)
    assert fired and got == want and stats.failovers == 1
    proc = clouds.clouds[clouds.index(fired[0]["url"])].proc
    assert proc.wait(30) == 0
    assert stats.failover_s < 10
    assert "going away" in caplog.text


def converse(split, urls, spec, sampling, monkeypatch=None, clouds=None, point=None):
    """Three turns; with `point`, the cloud is killed in the second one."""
    with edge_for(split, urls) as edge:
        chat = edge.conversation(system="be brief", spec=spec, sampling=sampling)
        answers, failovers = [], 0
        for i, user in enumerate(["abcabc abc", "abc abcabc", "cab cab"]):
            fired = arm(monkeypatch, clouds, point) if point and i == 1 else None
            r = chat.say(user, max_new_tokens=12)
            if fired is not None:
                assert fired, "the fault was not injected"  # (the hooks stay, inert: they fire once)
            answers.append(r.token_ids)
            failovers += r.stats.failovers
        chat.close()
    return answers, failovers


@pytest.mark.parametrize(
    "point,spec,sampling",
    [("prefill", NGRAM, None), ("pipelined", PIPELINED, SEEDED)],
    ids=["prefill-greedy", "pipelined-seeded"],
)
def test_conversation_fails_over_with_its_history(tiny_chat_split, clouds, monkeypatch, point, spec, sampling):
    """The cloud that held the first turn dies in the second: the new one gets the history replayed."""
    clouds.up()
    urls = [clouds.url(0), clouds.url(1)]
    want, _ = converse(tiny_chat_split, urls, spec, sampling)
    got, failovers = converse(tiny_chat_split, urls, spec, sampling, monkeypatch, clouds, point)
    assert got == want and failovers == 1


def sse_text(response) -> tuple[str, list[dict]]:
    events = [
        json.loads(line[6:])
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
    return text, events


@pytest.mark.parametrize(
    "point,body",
    [("spec", {"temperature": 0}), ("pipelined", {"temperature": 0.9, "seed": 3})],
    ids=["spec-greedy", "pipelined-seeded"],
)
def test_streamed_api_continues_without_an_error_event(tiny_chat_split, clouds, monkeypatch, point, body):
    from starlette.testclient import TestClient

    from splitlm.edge.api import APIConfig, EdgeAPI

    clouds.up()
    spec = PIPELINED if point == "pipelined" else NGRAM
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "abcabc abcabc"}],
        "max_tokens": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }

    def stream() -> tuple[str, list[dict]]:
        with edge_for(tiny_chat_split, [clouds.url(0), clouds.url(1)]) as edge:
            api = EdgeAPI(edge, APIConfig(model_name="tiny", spec=spec))
            try:
                with TestClient(api.app) as http:
                    response = http.post("/v1/chat/completions", json=request)
                assert response.status_code == 200
                return sse_text(response)
            finally:
                api.close()

    want, _ = stream()
    fired = arm(monkeypatch, clouds, point)
    got, events = stream()
    assert fired, "the fault was not injected"
    assert got == want and want
    assert not any("error" in e for e in events)
    assert events[-1]["splitlm"]["failovers"] == 1


def test_an_interrupted_turn_leaves_no_trace(tiny_chat_split, clouds):
    """A turn whose stream is closed after a few pieces: the next turn equals the conversation in
    which the interrupted turn never happened (both sides' caches were cropped back)."""
    clouds.up()
    with edge_for(tiny_chat_split, [clouds.url(0)]) as edge:
        spec = SpecConfig("ngram")
        clean = edge.conversation(spec=spec)
        clean.say("abcabc", max_new_tokens=10)
        want = clean.say("cab cab", max_new_tokens=16).token_ids
        clean.close()

        chat = edge.conversation(spec=spec)
        chat.say("abcabc", max_new_tokens=10)
        stream = chat.stream("abc abcabc abc", max_new_tokens=40)
        pieces = iter(stream)
        for _ in range(3):
            next(pieces)
        stream.close()
        assert chat.session.length == len(chat.cached)
        assert chat.say("cab cab", max_new_tokens=16).token_ids == want
        chat.close()


def test_a_reconnect_gives_up_after_the_failover_timeout(tiny_chat_split, clouds, monkeypatch):
    """No cloud comes back: the request fails with one clear error once the failover timeout is spent."""
    from splitlm.transport.client import CloudError

    clouds.up()
    fired = arm(monkeypatch, clouds, "spec")
    with Edge(
        tiny_chat_split / "edge", [clouds.url(0)], EdgeConfig(wire_dtype="fp32", device="cpu", failover_timeout_s=1.0)
    ) as edge:
        with pytest.raises(CloudError, match="failover gave up after 1 s"):
            edge.generate(PROMPT, max_new_tokens=24, stop_at_eos=False, spec=NGRAM)
    assert fired


def test_keepalive_pings_are_answered(tiny_chat_split, clouds):
    clouds.up()
    with Edge(tiny_chat_split / "edge", clouds.url(0), EdgeConfig(device="cpu", ping_interval_s=0.2)) as edge:
        time.sleep(0.8)
        assert edge.client.ws.latency > 0  # a pong came back
        assert edge.generate(PROMPT, max_new_tokens=4).token_ids


def test_a_half_open_link_is_found_by_the_pings(tiny_chat_split, clouds, monkeypatch):
    """The cloud freezes (SIGSTOP: its TCP connections stay up, nothing answers) during a step: the
    keepalive pings find the dead link within about two intervals, not at the 60 s reply timeout."""
    clouds.up()
    urls = [clouds.url(0), clouds.url(1)]
    want = undisturbed(tiny_chat_split, urls, NGRAM, None)
    fired = arm(monkeypatch, clouds, "spec", mode="freeze")
    with Edge(tiny_chat_split / "edge", urls, EdgeConfig(wire_dtype="fp32", device="cpu", ping_interval_s=0.5)) as edge:
        t0 = time.monotonic()
        r = edge.generate(PROMPT, max_new_tokens=24, stop_at_eos=False, spec=NGRAM)
        took = time.monotonic() - t0
    clouds.kill(fired[0]["url"])
    assert r.token_ids == want and r.stats.failovers == 1
    assert took < 15


def test_generations_with_a_link_cut_or_a_cloud_killed_at_random_all_match(tiny_chat_split, tmp_path):
    """The failover bench on two clouds behind emulated WANs: 16 consecutive generations, each with its
    link cut or its cloud SIGKILLed at a random moment (sequential and pipelined speculation, greedy
    and seeded sampling): every output equals the undisturbed one; cuts and kills are counted apart."""
    from splitlm.bench.failover import FaultPlan, Rig, cases_for, fault_runs
    from splitlm.bench.wan import WanConfig, WanEmulator
    from splitlm.cloud.local import LocalCloud

    clouds = [LocalCloud(tiny_chat_split / "cloud", tmp_path / f"cloud{i}.log", "cpu", "fp32") for i in range(2)]
    try:
        for cloud in clouds:
            cloud.start()
        with (
            WanEmulator(("127.0.0.1", clouds[0].port), WanConfig(rtt_ms=2)) as wan0,
            WanEmulator(("127.0.0.1", clouds[1].port), WanConfig(rtt_ms=2)) as wan1,
        ):
            rig = Rig(clouds, [wan0, wan1])
            with edge_for(tiny_chat_split, rig.urls) as edge:
                plan = FaultPlan(
                    PROMPT, cuts=12, kills=4, cases=cases_for("ngram"), max_new_tokens=24, repeats=1, seed=3
                )
                report = fault_runs(edge, rig, plan)
    finally:
        for cloud in clouds:
            cloud.stop()
    assert report["identical"] == report["total"] == 16, report["runs"]
    assert report["cut"]["total"] == 12 and report["kill"]["total"] == 4
    assert sum(c.kills for c in clouds) == 4
    # a fault may fall where no reply is owed (between requests, on a session's CLOSE): nothing to replay
    assert report["kill"]["failovers"] >= 1 and report["cut"]["failovers"] >= 6


def cut_once(edge, wan, prompt, spec, sampling=None, at: float = 0.7, n: int = 24):
    """The undisturbed output, and the output with the link cut once at fraction `at` of its traffic.
    `spec` must send the same trees each time (a fixed tree size): a step budget that sizes trees
    by what it learned would send less the second time, and the cut could fall after the answer."""

    def traffic() -> int:
        return wan.bytes_up + wan.bytes_down

    before = traffic()
    want = edge.generate(prompt, n, stop_at_eos=False, spec=spec, sampling=sampling).token_ids
    sent, before = traffic() - before, traffic()
    assert edge.generate(prompt, n, stop_at_eos=False, spec=spec, sampling=sampling).token_ids == want
    assert traffic() - before == sent, "the two undisturbed runs differ in traffic: the cut would fall elsewhere"
    wan.cut_after(int(sent * at))
    r = edge.generate(prompt, n, stop_at_eos=False, spec=spec, sampling=sampling)
    wan.cut_after(None)
    return want, r


@pytest.mark.parametrize("policy", ["none", "sealed", "window:8"])
def test_replay_under_every_cache_policy(tiny_split, tiny_server, policy):
    """Same tokens under `none` and `sealed`; under `window:N` the new cloud rebuilds its window from
    the last N head outputs (as after a revoke: its entries' KV is recomputed over a shorter
    context than the first time), so the request completes but its tokens may differ."""
    from splitlm.bench.wan import WanConfig, WanEmulator

    port = int(tiny_server.url.rsplit(":", 1)[1])
    with (
        WanEmulator(("127.0.0.1", port), WanConfig(rtt_ms=0)) as wan,
        Edge(
            tiny_split / "edge", wan.url_for("ws"), EdgeConfig(wire_dtype="fp32", device="cpu", cache_policy=policy)
        ) as edge,
    ):
        want, r = cut_once(edge, wan, [5, 6, 7, 8] * 5, SpecConfig("ngram", max_nodes=16))
    assert r.stats.failovers == 1 and wan.cuts == 1 and len(r.token_ids) == len(want)
    if policy != "window:8":
        assert r.token_ids == want


def test_replay_rebuilds_a_context_longer_than_one_forward(tiny_split, monkeypatch):
    """The cloud takes 16 tokens per forward: the replayed 60-token context goes up in chunks."""
    rebuilt = []
    rebuild = replay_module.rebuild
    monkeypatch.setattr(
        replay_module, "rebuild", lambda link, upto, then: rebuilt.append(rebuild(link, upto, then)) or rebuilt[-1]
    )
    from splitlm.bench.wan import WanConfig, WanEmulator
    from splitlm.cloud.server import BackgroundServer
    from splitlm.cloud.sessions import ServerLimits

    with (
        BackgroundServer(tiny_split / "cloud", limits=ServerLimits(max_tokens_per_forward=16)) as server,
        WanEmulator(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), WanConfig(rtt_ms=0)) as wan,
        Edge(tiny_split / "edge", wan.url_for("ws"), EdgeConfig(wire_dtype="fp32", device="cpu")) as edge,
    ):
        want, r = cut_once(edge, wan, list(range(3, 63)), SpecConfig("none"), at=0.9)
    assert r.token_ids == want and r.stats.failovers == 1
    assert rebuilt and rebuilt[0] >= 48


def test_replay_on_a_split_head_cloud(tiny_split_head, split_head_server):
    from splitlm.bench.wan import WanConfig, WanEmulator

    port = int(split_head_server.url.rsplit(":", 1)[1])
    with (
        WanEmulator(("127.0.0.1", port), WanConfig(rtt_ms=0)) as wan,
        Edge(tiny_split_head / "edge", wan.url_for("ws"), EdgeConfig(wire_dtype="fp32", device="cpu")) as edge,
    ):
        want, r = cut_once(edge, wan, [5, 6, 7, 8] * 5, SpecConfig("ngram", max_nodes=16), SEEDED)
    assert r.token_ids == want and r.stats.failovers == 1
