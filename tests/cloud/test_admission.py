"""Progress under memory pressure (`cloud.preemption`): a younger session never takes memory from an
older one that is running; an older session's step waits for a younger one's pass rather than be
refused; CAPACITY says what holds the budget; and edges on a budget below one full context all finish."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

import splitlm.cloud.runner as runner_module
from conftest import cloud_forward
from splitlm.cloud.preemption import RUNNING_S, room
from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits
from splitlm.model.paged_kv import BLOCK_SIZE
from splitlm.model.shards import Manifest
from splitlm.transport.client import CloudClient, CloudError
from splitlm.transport.errors import ErrorCode
from splitlm.transport.messages import Control, Forward, Open

BLOCK_BYTES = BLOCK_SIZE * 512  # one block of the tiny cloud's (paged) cache (tests/cloud/test_budget.py)


@dataclass(eq=False)
class Fake:
    """What `room` reads of a session."""

    opened: float
    last_used: float
    kv_reserved: int = 100
    active: int = 0
    grace_until: float = 0.0
    name: str = field(default="")


def test_a_younger_session_never_frees_an_older_running_one():
    now = time.monotonic()
    old_running = Fake(opened=now - 50, last_used=now - RUNNING_S / 4, name="old running")
    old_idle = Fake(opened=now - 40, last_used=now - 3 * RUNNING_S, name="old idle")
    young_running = Fake(opened=now - 5, last_used=now - RUNNING_S / 8, name="young running")
    young_busy = Fake(opened=now - 4, last_used=now, active=1, name="young mid-request")
    sessions = [old_running, old_idle, young_running, young_busy]

    # an OPEN (younger than all): only the idle session may go
    assert room(sessions, 100).victims == [old_idle]
    opening = room(sessions, 200)
    assert opening.victims is None and not opening.wait  # an OPEN never waits
    assert opening.held == {"running": 200, "mid-request": 100}

    # a step of a session between the old ones and the young ones: idle first, then the younger running one
    middle = Fake(opened=now - 30, last_used=now)
    plan = room([*sessions, middle], 200, middle)
    assert plan.victims == [old_idle, young_running]
    # more than that: the younger one mid-request would make room after its pass, so the step waits
    plan = room([*sessions, middle], 300, middle)
    assert plan.victims is None and plan.wait and plan.held["running"] == 100
    # ... but never for more than the younger sessions and the idle ones hold together
    assert not room([*sessions, middle], 400, middle).wait

    # the oldest running session may free anyone but itself; a just-opened session is spared only
    # against younger requesters (its grace protects it from OPENs, not from older steps)
    fresh = Fake(opened=now - 1, last_used=now - 1, grace_until=now + 5)
    assert fresh not in (room([old_idle, fresh], 200).victims or [])
    assert room([old_running, fresh], 100, old_running).victims == [fresh]


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


def send(client: CloudClient, sid: int, rows: int, start: int = 0):
    h = torch.randn(rows, 64)
    return client.send_forward(sid, Forward(h, torch.arange(start, start + rows), control=Control()), "fp32", h.numel())


def test_an_older_step_waits_for_a_younger_pass_then_frees_it_and_opens_are_refused_meanwhile(tiny_split, gate):
    fp = Manifest.read(tiny_split / "edge", "edge").fingerprint
    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(kv_budget_bytes=3 * BLOCK_BYTES)) as server:
        cloud = server.server
        c1, c2, c3 = (CloudClient(server.url, fp) for _ in range(3))
        try:
            old = c1.open(Open("fp32")).session
            cloud_forward(c1, old, torch.randn(8, 64), list(range(8)), "fp32")
            young = c2.open(Open("fp32")).session
            cloud_forward(c2, young, torch.randn(BLOCK_SIZE + 4, 64), list(range(BLOCK_SIZE + 4)), "fp32")
            with pytest.raises(CloudError) as e:  # both are running: a newcomer may free neither
                c3.open(Open("fp32"))
            assert e.value.code == ErrorCode.CAPACITY and e.value.recoverable
            assert "2 sessions hold it" in str(e.value) and "running" in str(e.value) and "KB short" in str(e.value)

            gate.clear()
            pending_young = send(c2, young, 4, start=BLOCK_SIZE + 4)  # in a pass, held at the gate
            deadline = time.monotonic() + 10
            while sum(cloud.scheduler.load()) < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            pending_old = send(c1, old, 2 * BLOCK_SIZE, start=8)  # needs two more blocks: the younger one's
            time.sleep(0.3)
            assert set(cloud.sessions.sessions) == {old, young}  # waiting, not refused, nothing freed yet
            gate.set()
            assert c2.receive_forward(pending_young).cache_len == BLOCK_SIZE + 8  # the younger step completes...
            assert c1.receive_forward(pending_old).cache_len == 2 * BLOCK_SIZE + 8  # ...then gives way to the older
            assert set(cloud.sessions.sessions) == {old} and cloud.stats.preemptions == 1
            with pytest.raises(CloudError) as e:
                c2.receive_forward(send(c2, young, 1, start=BLOCK_SIZE + 8))
            assert e.value.code == ErrorCode.PREEMPTED
        finally:
            gate.set()
            for c in (c1, c2, c3):
                c.close()
