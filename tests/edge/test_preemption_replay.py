"""A preempted session, as its edge sees it: the cloud freed it between two steps (sequential, or with a
pipelined step sent after it), the next request is answered PREEMPTED, and the edge reopens a session
on the same connection and replays its context; the output equals an undisturbed run (greedy and
seeded sampling; session, sealed and none cache policies)."""

from __future__ import annotations

import asyncio

import pytest

from splitlm.cloud.server import BackgroundServer
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.sampling import SamplingConfig
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.link import CloudLink
from splitlm.transport.client import CloudClient

PROMPT = [5, 6, 7, 8] * 5


@pytest.fixture(autouse=True)
def always_bet(monkeypatch):
    """Pipelined steps bet whenever they can (at loopback latency a bet would rarely pay)."""
    from splitlm.decoding import pipeline

    monkeypatch.setattr(pipeline.PipelinedFlow, "pays", lambda self, p, nodes: True)  # what `always_bet` does


@pytest.fixture(scope="module")
def cloud(tiny_split):
    with BackgroundServer(tiny_split / "cloud") as server:
        yield server


def preempt(server: BackgroundServer, sid: int) -> None:
    """Free session `sid` on the cloud's event loop, as a full budget would, once it is idle there."""

    async def free() -> None:
        table = server.server.sessions
        while table.sessions[sid].active:
            await asyncio.sleep(0.001)
        table.preempt(sid, idle=False)

    asyncio.run_coroutine_threadsafe(free(), server.loop).result(10)


# when to free the session: called before a block goes up, with the session's cloud side (its blocks in flight)
POINTS = {
    "before-a-step": lambda link: link.stats.round_trips >= 2 and len(link.flights) == 1,
    "before-a-pipelined-step": lambda link: len(link.flights) == 2,  # the first one answered, the second owed
}


def run(split, server, spec, sampling, policy, point=None, monkeypatch=None):
    fired = []
    if point is not None:
        transmit = CloudLink.transmit

        def preempting_transmit(self, f, c):
            if not fired and POINTS[point](self):
                preempt(server, self.id)
                fired.append(len(self.flights))
            transmit(self, f, c)

        monkeypatch.setattr(CloudLink, "transmit", preempting_transmit)
    with Edge(
        split / "edge", server.url, EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32", cache_policy=policy)
    ) as edge:
        r = edge.generate(PROMPT, max_new_tokens=20, stop_at_eos=False, spec=spec, sampling=sampling)
    if point is not None:
        monkeypatch.undo()
        assert fired, "the session was not preempted where the test meant"
    return r


CASES = [
    ("before-a-step", SpecConfig("ngram"), None, "session"),
    ("before-a-pipelined-step", SpecConfig("ngram", pipeline=True), None, "session"),
    ("before-a-step", SpecConfig("ngram", pipeline=True), None, "session"),  # a bet follows
    ("before-a-step", SpecConfig("ngram"), SamplingConfig(temperature=0.9, seed=7), "session"),
    ("before-a-step", SpecConfig("ngram"), None, "sealed"),
    ("before-a-step", SpecConfig("ngram"), None, "none"),
]


@pytest.mark.parametrize(
    "point,spec,sampling,policy", CASES, ids=["step", "pipelined", "pipelined-bet-owed", "seeded", "sealed", "none"]
)
def test_a_preempted_session_replays_and_its_output_is_unchanged(
    tiny_split, cloud, monkeypatch, point, spec, sampling, policy
):
    want = run(tiny_split, cloud, spec, sampling, policy)
    before, dropped = cloud.server.stats.replays, []
    drop_replies = CloudClient.drop_replies
    monkeypatch.setattr(CloudClient, "drop_replies", lambda client: dropped.append(drop_replies(client)) or dropped[-1])
    r = run(tiny_split, cloud, spec, sampling, policy, point, monkeypatch)
    assert r.token_ids == want.token_ids
    assert r.stats.preemptions == 1 and r.stats.failovers == 0
    # the replies still owed on the connection were taken first: a pipelined bet's, when it was sent before
    # the PREEMPTED answer came back (a race, so only bounded)
    assert len(dropped) == 1 and dropped[0] <= int(spec.pipeline)
    assert cloud.server.stats.replays == before + 1  # it reopened on the same connection
