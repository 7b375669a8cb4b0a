"""The prefix pool on its own (no HTTP): reused requests equal cold ones after cancelled, failed and
lost-cloud requests, exclusivity, the limits (count, memory, idle time) and the cache policies."""

import pytest

from splitlm.cloud.server import BackgroundServer
from splitlm.decoding.modes import SpecConfig
from splitlm.edge import Edge, EdgeConfig, GenerationRequest
from splitlm.edge.prefix_pool import PoolLimits, PrefixPool, reuse_allowed
from splitlm.transport.policy import CachePolicy

SPEC = SpecConfig("ngram")
SYSTEM = list(range(40, 100))  # a shared prefix of 60 token ids
A = SYSTEM + [7, 8, 9, 10, 11, 12]
B = SYSTEM + [200, 201, 202, 203]


@pytest.fixture(scope="module")
def cloud(tiny_chat_split):
    with BackgroundServer(tiny_chat_split / "cloud") as server:
        yield server


@pytest.fixture(scope="module")
def edge(tiny_chat_split, cloud):
    with Edge(tiny_chat_split / "edge", cloud.url, EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint)) as e:
        yield e


def run(pool, ids, n=12, sampling=None, cache_policy=None, interrupt=None):
    stream = pool.stream(GenerationRequest(ids, n, spec=SPEC, sampling=sampling), cache_policy, interrupt)
    text = "".join(stream)
    return stream.result, text


def cold(edge, ids, n=12):
    return edge.generate(ids, n, spec=SPEC).token_ids


def open_sessions(cloud) -> int:
    return len(cloud.server.sessions.sessions)


def test_a_conversation_reuses_its_state_and_equals_cold(edge):
    pool = PrefixPool(edge, PoolLimits(ttl_s=0))
    try:
        first, _ = run(pool, A)
        assert first.stats.cached_tokens == 0 and first.token_ids == cold(edge, A)
        turn = A + first.token_ids + [13, 14, 15]
        second, _ = run(pool, turn)
        # the pooled state held A and the answer less its last token (never fed back)
        assert second.stats.cached_tokens == len(A) + len(first.token_ids) - 1
        assert second.token_ids == cold(edge, turn)
        again, _ = run(pool, turn)  # the same prompt again: all but its last token reused
        assert again.stats.cached_tokens == len(turn) - 1 and again.token_ids == second.token_ids
        c = pool.counters
        assert c.hit_tokens == second.stats.cached_tokens + again.stats.cached_tokens
        assert c.queried_tokens == len(A) + 2 * len(turn)
        assert pool.usage().sessions == 1
    finally:
        pool.close()


def test_a_shared_prefix_serves_another_conversation(edge):
    pool = PrefixPool(edge, PoolLimits(ttl_s=0))
    try:
        run(pool, A)
        other, _ = run(pool, B)
        assert other.stats.cached_tokens == len(SYSTEM)  # up to where the token ids part
        assert other.token_ids == cold(edge, B)
    finally:
        pool.close()


@pytest.mark.parametrize("spec", ["ngram", "pipelined"])
def test_a_cancelled_stream_leaves_the_prompt_and_a_retry_equals_cold(edge, cloud, spec):
    spec = SpecConfig("ngram", pipeline=spec == "pipelined")
    pool = PrefixPool(edge, PoolLimits(ttl_s=0))
    try:
        run(pool, A)
        turn = A + [30, 31, 32, 33]
        stream = pool.stream(GenerationRequest(turn, 200, stop_at_eos=False, spec=spec))
        pieces = iter(stream)
        for _ in range(3):
            next(pieces)
        stream.close()
        assert pool.usage().sessions == 1
        [entry] = pool.entries
        assert entry.ids == turn and entry.session.length == len(turn)  # what was committed, no half-step
        retry = pool.stream(GenerationRequest(turn, 24, stop_at_eos=False, spec=spec))
        "".join(retry)
        assert retry.result.stats.cached_tokens == len(turn) - 1
        assert retry.result.token_ids == edge.generate(turn, 24, spec=spec, stop_at_eos=False).token_ids
    finally:
        pool.close()
    assert open_sessions(cloud) == 0


def test_an_interrupted_prefill_stops_between_chunks_and_a_retry_equals_cold(tiny_chat_split, cloud):
    asked = []

    def interrupt() -> bool:
        asked.append(1)
        return len(asked) == 3

    with Edge(
        tiny_chat_split / "edge", cloud.url, EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint, prefill_chunk=8)
    ) as chunked:
        pool = PrefixPool(chunked, PoolLimits(ttl_s=0))
        try:
            stopped, text = run(pool, A, interrupt=interrupt)
            assert stopped is None and text == "" and len(asked) == 3  # at the third of the prompt's 9 chunks
            [entry] = pool.entries
            assert entry.session.length == len(entry.ids) == 0  # nothing of the request is kept
            again, _ = run(pool, A, interrupt=lambda: False)
            assert again.token_ids == cold(chunked, A) and len(asked) == 3
        finally:
            pool.close()


def test_a_failed_request_is_cropped_back_and_the_next_equals_cold(edge, monkeypatch):
    pool = PrefixPool(edge, PoolLimits(ttl_s=0))
    try:
        first, _ = run(pool, A)
        turn = A + first.token_ids + [13, 14]
        calls = []
        real = edge.backend.finish

        def failing(*args):
            calls.append(1)
            if len(calls) == 2:  # the first decoding step, after the prefill
                raise RuntimeError("the edge failed half-way")
            return real(*args)

        monkeypatch.setattr(edge.backend, "finish", failing)
        with pytest.raises(RuntimeError):
            run(pool, turn)
        monkeypatch.undo()
        [entry] = pool.entries
        assert entry.session.length == len(entry.ids) == len(A) + len(first.token_ids) - 1  # as before the request
        again, _ = run(pool, turn)
        assert again.stats.cached_tokens == len(entry.ids) and again.token_ids == cold(edge, turn)
    finally:
        pool.close()


def test_two_requests_on_one_prefix_at_once_do_not_share_it(edge):
    pool = PrefixPool(edge, PoolLimits(ttl_s=0))
    try:
        run(pool, A)
        turn = A + [1, 2, 3]
        one, two = (
            pool.stream(GenerationRequest(turn, 8, spec=SPEC)),
            pool.stream(GenerationRequest(turn, 8, spec=SPEC)),
        )
        next(iter(one))  # checked out by the first
        "".join(two)
        "".join(one)
        assert {one.result.stats.cached_tokens, two.result.stats.cached_tokens} == {0, len(A)}
        assert one.result.token_ids == two.result.token_ids == cold(edge, turn, 8)
        assert pool.usage().sessions == 2
    finally:
        pool.close()


def test_the_memory_cap_evicts_the_least_recently_used(edge, cloud):
    probe = PrefixPool(edge, PoolLimits(ttl_s=0))
    run(probe, A)
    one = probe.usage()
    probe.close()
    assert one.edge_bytes > 0 and one.cloud_bytes > 0
    cap_mb = 1.5 * one.edge_bytes / 2**20  # room for one state, not two
    pool = PrefixPool(edge, PoolLimits(sessions=8, megabytes=cap_mb, ttl_s=0))
    try:
        run(pool, A)
        run(pool, [3, 4, 5, 6, 7, 8])  # nothing in common: a second state, over the cap
        assert pool.usage().sessions == 1 and pool.counters.evictions == 1
        assert open_sessions(cloud) == 1  # the evicted state's cloud session is closed
        again, _ = run(pool, A + [9])
        assert again.stats.cached_tokens == 0  # A's state was the one evicted
        evictions = pool.counters.evictions
        run(pool, [30 + i % 200 for i in range(300)])  # over 256 entries: alone over the cap, closed at once
        assert pool.usage().sessions == 1 and pool.counters.evictions == evictions + 1
        assert run(pool, A + [9, 10])[0].stats.cached_tokens == len(A) + 1
    finally:
        pool.close()
    assert open_sessions(cloud) == 0


def test_count_limit_and_idle_time(edge, cloud):
    pool = PrefixPool(edge, PoolLimits(sessions=1, ttl_s=0))
    try:
        run(pool, A)
        run(pool, [3, 4, 5, 6])
        assert pool.usage().sessions == 1 and pool.counters.evictions == 1
        assert pool.expire(now=pool.entries[0].since + 1) == 0  # ttl 0: no idle limit
    finally:
        pool.close()
    pool = PrefixPool(edge, PoolLimits(ttl_s=0.2))
    try:
        run(pool, A)
        assert pool.usage().sessions == 1
        pool.closed.wait(1.0)  # the sweeper closes it after 0.2 s
        assert pool.usage().sessions == 0 and open_sessions(cloud) == 0
    finally:
        pool.close()


def test_none_never_reuses_and_window_only_within_its_window(edge, cloud):
    pool = PrefixPool(edge, PoolLimits(ttl_s=0))
    try:
        for _ in range(2):
            result, _ = run(pool, A, cache_policy="none")
            assert result.stats.cached_tokens == 0
        assert pool.usage().sessions == 0 and pool.counters.queried_tokens == 0 and open_sessions(cloud) == 0
        run(pool, A)  # a session state: not for a request under another policy
        result, _ = run(pool, A + [1], cache_policy="sealed")
        assert result.stats.cached_tokens == 0
        sealed, _ = run(pool, A + [1, 2], cache_policy="sealed")  # but for the next sealed one
        assert sealed.stats.cached_tokens == len(A) + 1 and sealed.token_ids == cold(edge, A + [1, 2])
        for _ in range(2):
            window, _ = run(pool, B, cache_policy="window:80")  # 64 + 12 tokens fit in 80
        assert window.stats.cached_tokens == len(B) - 1 and window.token_ids == cold(edge, B)
        wide, _ = run(pool, B, 30, cache_policy="window:80")  # 64 + 30 do not
        assert wide.stats.cached_tokens == 0
    finally:
        pool.close()
    assert not reuse_allowed(CachePolicy.parse("none"), 1)
    assert reuse_allowed(CachePolicy.parse("window:8"), 8) and not reuse_allowed(CachePolicy.parse("window:8"), 9)


def test_a_server_wide_none_never_pools(tiny_chat_split, cloud):
    with Edge(
        tiny_chat_split / "edge",
        cloud.url,
        EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint, cache_policy="none"),
    ) as edge:
        pool = PrefixPool(edge, PoolLimits(ttl_s=0))
        try:
            for _ in range(2):
                assert run(pool, A)[0].stats.cached_tokens == 0
            assert pool.usage().sessions == 0 and open_sessions(cloud) == 0
        finally:
            pool.close()


def test_a_lost_cloud_is_replayed_and_a_forgotten_session_prefilled_afresh(tiny_chat_split):
    cloud = BackgroundServer(tiny_chat_split / "cloud").__enter__()
    port = cloud.server.port
    edge = Edge(
        tiny_chat_split / "edge",
        cloud.url,
        EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint, failover_timeout_s=10.0),
    )
    pool = PrefixPool(edge, PoolLimits(ttl_s=0))
    try:
        first, _ = run(pool, A)
        turn = A + first.token_ids + [1, 2]
        want = cold(edge, turn)
        cloud.__exit__(None, None, None)  # the cloud restarts between two turns: the pooled session is lost
        cloud = BackgroundServer(tiny_chat_split / "cloud", port=port, identity=cloud.server.identity).__enter__()
        second, _ = run(pool, turn)
        assert second.stats.failovers == 1 and second.stats.cached_tokens > len(A)  # replayed from the edge
        assert second.token_ids == want
        [sid] = cloud.server.sessions.sessions  # the cloud forgets the pooled session (UNKNOWN_SESSION)
        cloud.loop.call_soon_threadsafe(cloud.server.sessions.remove, sid)
        third_ids = turn + second.token_ids + [3]
        third, _ = run(pool, third_ids)
        assert pool.counters.fallbacks == 1 and third.stats.cached_tokens == 0
        assert third.token_ids == cold(edge, third_ids)
    finally:
        pool.close()
        edge.close()
        cloud.__exit__(None, None, None)


def test_seeded_sampling_reused_equals_cold(edge):
    from splitlm.decoding.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=0.9, seed=3)
    pool = PrefixPool(edge, PoolLimits(ttl_s=0))
    try:
        first, _ = run(pool, A, sampling=sampling)
        turn = A + first.token_ids + [5]
        second, _ = run(pool, turn, 16, sampling=sampling)
        assert second.stats.cached_tokens == len(turn) - 2
        assert second.token_ids == edge.generate(turn, 16, spec=SPEC, sampling=sampling).token_ids
    finally:
        pool.close()
