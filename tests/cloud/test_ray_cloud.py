"""The cloud on Ray (2 replicas x 2 stages on one local Ray instance): the single-process cloud's
tokens, sessions kept on one replica, placed by load, and a lost replica's sessions replayed."""

import threading
import time

import pytest

from splitlm.cloud.scheduler import BatchConfig
from splitlm.cloud.server import BackgroundServer
from splitlm.decoding.modes import SpecConfig
from splitlm.edge import Edge, EdgeConfig
from splitlm.transport.frames import MsgType

ray = pytest.importorskip("ray")

from splitlm.cloud.ray_cloud import RayConfig, RayFrontDoor, actor_name  # noqa: E402

PROMPTS = [
    [5, 6, 7],
    [9, 3, 8, 1],
    [12, 40],
    [7, 7, 7, 7, 7],
    [100, 3, 100, 3, 100],
    [(11 * i) % 200 + 3 for i in range(37)],
]  # mixed lengths (the last one is chunked: prefill_chunk 16)
POLICIES = ["session", "none"]
BATCH = BatchConfig(max_batch=8, prefill_chunk=16)


@pytest.fixture(scope="module")
def ray_instance():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        namespace="splitlm-test",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cloud(ray_instance, tiny_split):
    config = RayConfig(replicas=2, stages=2, namespace="splitlm-test")
    with BackgroundServer(tiny_split / "cloud", server_cls=RayFrontDoor, ray=config, batch=BATCH) as server:
        yield server


def generate_all(split, url: str, max_new: int, concurrent: bool) -> list[list[int]]:
    """Every prompt's greedy tokens (`auto` speculation, one session pipelined), one after another or all at once."""
    edges = [Edge(split / "edge", url, EdgeConfig(wire_dtype="fp32", cache_policy=p)) for p in POLICIES]
    results, errors = [None] * len(PROMPTS), []

    def run(i):
        spec = SpecConfig("auto", pipeline=i == 3)
        try:
            results[i] = (
                edges[i % 2].generate(PROMPTS[i], max_new_tokens=max_new, stop_at_eos=False, spec=spec).token_ids
            )
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    try:
        if concurrent:
            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
        else:
            for i in range(len(PROMPTS)):
                run(i)
    finally:
        for e in edges:
            e.close()
    assert not errors, errors
    return results


def test_ray_cloud_equals_the_single_process_cloud(tiny_split, ray_cloud):
    """6 concurrent greedy sessions (fp32, speculative, mixed cache policies) on 2 replicas x 2 stages give the
    single-process cloud's tokens; new sessions are spread over both replicas, each kept on one."""
    with BackgroundServer(tiny_split / "cloud", batch=BATCH) as single:
        expected = generate_all(tiny_split, single.url, 16, concurrent=False)
    door = ray_cloud.server
    placed = dict(door.placed)
    assert generate_all(tiny_split, ray_cloud.url, 16, concurrent=True) == expected
    new = {r: door.placed[r] - placed.get(r, 0) for r in (0, 1)}
    assert sum(new.values()) >= len(PROMPTS) and min(new.values()) >= 2, new  # placed by load on both
    assert door.sessions.sessions == {}  # closed, on the replica each was opened on (sticky)
    config = RayConfig(replicas=2, stages=2, namespace="splitlm-test")  # a second front door: the same replicas
    with BackgroundServer(tiny_split / "cloud", server_cls=RayFrontDoor, ray=config, batch=BATCH) as second:
        assert not any(r.owned for r in second.server.replicas)
        assert generate_all(tiny_split, second.url, 16, concurrent=True) == expected


@pytest.mark.parametrize("stage", [1, 0])
def test_a_killed_replica_actor_is_survived_with_identical_output(tiny_split, ray_cloud, stage):
    """Mid-generation (just before the 4th FORWARD the front door sends the replica), one actor of a replica
    holding sessions is killed (a later stage, then stage 0): the edges of its sessions fail over by replay to
    the other replica with the same tokens, and Ray restarts the actor."""
    door = ray_cloud.server
    max_new = 40
    with BackgroundServer(tiny_split / "cloud", batch=BATCH) as single:
        expected = generate_all(tiny_split, single.url, max_new, concurrent=False)
    victim = 1 - stage  # the replica whose actor dies
    actor = ray.get_actor(actor_name(door.manifest.fingerprint, victim, stage), namespace="splitlm-test")
    before, lost, forwards = ray.get(actor.ping.remote()), door.lost, []
    call = door.call

    async def call_and_kill(index, conn, frame, incarnation):
        if index == victim and frame.type == MsgType.FORWARD:
            forwards.append(frame.session)
            if len(forwards) == 4:
                ray.kill(actor, no_restart=False)
        return await call(index, conn, frame, incarnation)

    door.call = call_and_kill
    try:
        assert generate_all(tiny_split, ray_cloud.url, max_new, concurrent=True) == expected
    finally:
        del door.call
    assert len(forwards) >= 4  # the kill happened, while sessions were open on the replica:
    assert door.lost > lost  # and they were ended and replayed elsewhere
    assert restarted(actor) != before  # Ray restarted the actor (a new incarnation)


def restarted(actor, timeout_s: float = 120) -> str:
    """The actor's incarnation once it answers again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.ping.remote(), timeout=timeout_s)
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline
            time.sleep(0.5)


def test_split_head_on_three_stages_and_no_sealed_caches(tiny_split_head, ray_instance):
    """The split-head topology (stage 0 also holds the final norm and the cloud's LM-head columns) over 3 stages
    gives the single-process cloud's tokens; a sealed cache policy is refused with POLICY (not kept per stage)."""
    from splitlm.transport.client import CloudError
    from splitlm.transport.errors import ErrorCode

    def run(url):
        with Edge(tiny_split_head / "edge", url, EdgeConfig(wire_dtype="fp32")) as edge:
            return [edge.generate(p, max_new_tokens=10, stop_at_eos=False, spec="auto").token_ids for p in PROMPTS[:2]]

    with BackgroundServer(tiny_split_head / "cloud") as single:
        expected = run(single.url)
    config = RayConfig(replicas=1, stages=3, namespace="splitlm-test")
    with BackgroundServer(tiny_split_head / "cloud", server_cls=RayFrontDoor, ray=config) as server:
        assert run(server.url) == expected
        with (
            Edge(tiny_split_head / "edge", server.url, EdgeConfig(cache_policy="sealed")) as edge,
            pytest.raises(CloudError) as err,
        ):
            edge.generate(PROMPTS[0], max_new_tokens=2)
        assert err.value.code == ErrorCode.POLICY
