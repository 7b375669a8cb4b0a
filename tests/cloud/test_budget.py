"""The KV memory budget: sessions reserve what their caches allocate; beyond the budget, CAPACITY."""

import time

import pytest
import torch

import splitlm.cloud.preemption as preemption
from conftest import cloud_forward, scrape_metrics
from splitlm.cloud.budget import KVBudget
from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits
from splitlm.edge.api_requests import cloud_failure
from splitlm.model.paged_kv import BLOCK_SIZE
from splitlm.model.shards import Manifest, load_cloud
from splitlm.transport.client import CloudClient, CloudError
from splitlm.transport.errors import ErrorCode
from splitlm.transport.messages import Control, Open


def test_bytes_per_entry_and_whole_blocks(tiny_split):
    budget = KVBudget.for_model(load_cloud(tiny_split / "cloud"), 10**6)
    assert budget.bytes_per_entry == 2 * 2 * 2 * 16 * 4  # k and v, 2 cloud layers, 2 KV heads, head dim 16, fp32
    assert budget.need(0) == budget.need(1) == budget.need(BLOCK_SIZE) == BLOCK_SIZE * 512  # paged: blocks of 16
    assert budget.need(BLOCK_SIZE + 1) == 2 * BLOCK_SIZE * 512 and budget.entries == 10**6 // 512
    assert KVBudget.for_model(load_cloud(tiny_split / "cloud"), 10**6, 256).need(257) == 2 * 256 * 512  # contiguous
    assert KVBudget.for_model(load_cloud(tiny_split / "cloud")).budget_bytes > 0  # automatic


BLOCK_BYTES = BLOCK_SIZE * 512  # one block of the tiny cloud's (paged) cache
TWO_BLOCKS = BLOCK_SIZE + BLOCK_SIZE // 2  # rows that take two blocks


def test_a_full_budget_preempts_the_least_recently_active_sessions_and_frees_on_close(tiny_split, monkeypatch):
    """A new session, or a step that grows one, frees the least recently active idle session(s) instead
    of being refused; their edges are told PREEMPTED (only they: others learn nothing)."""
    monkeypatch.setattr(preemption, "RUNNING_S", 0.0)  # a session is idle once its reply is out (the LRU order)
    fp = Manifest.read(tiny_split / "edge", "edge").fingerprint
    limits = ServerLimits(kv_budget_bytes=3 * BLOCK_BYTES)
    with BackgroundServer(tiny_split / "cloud", limits=limits) as server:
        table, client = server.server.sessions, CloudClient(server.url, fp)
        try:
            a, b, c = [client.open(Open("fp32")).session for _ in range(3)]
            h = torch.randn(TWO_BLOCKS, 64)
            with pytest.raises(CloudError) as e:  # sessions just opened are not preempted before their first step
                client.open(Open("fp32"))
            assert e.value.code == ErrorCode.CAPACITY
            for sid in (b, c, a):  # `a` is now the most recently active, `b` the least
                cloud_forward(client, sid, h[:10], list(range(10)), "fp32")
            d = client.open(Open("fp32")).session  # no room: `b` goes
            assert set(table.sessions) == {a, c, d} and table.kv_reserved == 3 * BLOCK_BYTES
            with pytest.raises(CloudError) as e:
                cloud_forward(client, b, h[:4], list(range(4)), "fp32")
            assert e.value.code == ErrorCode.PREEMPTED and e.value.retryable
            grow = 2 * BLOCK_SIZE - 10  # grows to two blocks: `c` goes
            result = cloud_forward(client, a, h[:grow], list(range(10, 10 + grow)), "fp32")
            assert result.hidden.shape == (grow, 64) and result.cache_len == 2 * BLOCK_SIZE
            assert set(table.sessions) == {a, d} and table.kv_reserved == 3 * BLOCK_BYTES
            assert server.server.stats.preemptions == 2 and server.server.stats.replays == 0
            cloud_forward(client, d, h[:10], list(range(10)), "fp32")
            e2 = client.open(Open("fp32")).session  # after a PREEMPTED answer to this client: a replay
            assert server.server.stats.replays == 1 and set(table.sessions) == {d, e2}  # `a` made room for it
            other = CloudClient(server.url, fp)  # the same client key on another connection: no such session
            with pytest.raises(CloudError) as e:
                cloud_forward(other, c, h[:4], list(range(4)), "fp32")
            assert e.value.code == ErrorCode.UNKNOWN_SESSION
            other.close()
            assert client.close_session(c).session == c  # closing a preempted session forgets it
            with pytest.raises(CloudError) as e:
                client.close_session(c)
            assert e.value.code == ErrorCode.UNKNOWN_SESSION
            text = server.server.scrape().decode()
            assert "splitlm_cloud_num_preemptions_total 3.0" in text and "splitlm_cloud_replays_total 1.0" in text
            assert scrape_metrics(text)["splitlm_cloud_kv_cache_usage_perc"] == pytest.approx(2 / 3)  # d and e2
            client.close_session(d)
            none = client.open(Open("fp32", "none")).session  # keeps nothing between requests: one block reserved
            cloud_forward(client, none, h[:5], list(range(5)), "fp32", control=Control(cache=False))
            assert table.sessions[none].kv_reserved == BLOCK_BYTES
        finally:
            client.close()
        deadline = time.monotonic() + 10
        while (table.sessions or len(table.tombstones)) and time.monotonic() < deadline:  # dropped with the connection
            time.sleep(0.05)
        assert table.kv_reserved == 0 and not table.sessions and not len(table.tombstones)


def test_a_step_larger_than_the_whole_budget_is_refused_for_good_at_once(tiny_split):
    """A step larger than the whole budget: EXCEEDS_BUDGET (permanent: no retry, no failover), nothing
    preempted, the session unchanged."""
    fp = Manifest.read(tiny_split / "edge", "edge").fingerprint
    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(kv_budget_bytes=BLOCK_BYTES)) as server:
        client = CloudClient(server.url, fp)
        try:
            a = client.open(Open("fp32")).session
            t0 = time.monotonic()
            with pytest.raises(CloudError) as e:
                cloud_forward(client, a, torch.randn(TWO_BLOCKS, 64), list(range(TWO_BLOCKS)), "fp32")
            assert time.monotonic() - t0 < 1.0
            assert e.value.code == ErrorCode.EXCEEDS_BUDGET and not e.value.recoverable and not e.value.retryable
            assert "it can never fit here" in str(e.value) and f"needs {TWO_BLOCKS} cache entries" in str(e.value)
            assert list(server.server.sessions.sessions) == [a] and server.server.stats.preemptions == 0
            assert server.server.sessions.sessions[a].cache.length == 0
        finally:
            client.close()


def test_the_local_api_answers_503_with_retry_after_at_capacity_and_400_beyond_the_budget():
    full = cloud_failure(CloudError("full", ErrorCode.CAPACITY))
    assert full.status == 503 and full.code == "cloud_capacity" and int(full.headers["Retry-After"]) > 0
    never = cloud_failure(CloudError("too large", ErrorCode.EXCEEDS_BUDGET))
    assert never.status == 400 and never.code == "cloud_budget_exceeded" and not never.headers
    assert cloud_failure(CloudError("gone")).status == 502


def test_a_prompt_beyond_the_whole_budget_fails_at_once_as_a_400_and_growing_past_it_mid_answer(tiny_split):
    """HELLO_OK announces what the whole budget holds: the edge refuses a prompt beyond it before sending
    anything (serve-edge: 400 cloud_budget_exceeded); an answer that grows past it gets the cloud's
    EXCEEDS_BUDGET at once, never a retry loop."""
    import json
    import urllib.error
    import urllib.request

    from conftest import serving
    from splitlm.edge import Edge, EdgeConfig, GenerationRequest
    from splitlm.edge.api import APIConfig, EdgeAPI

    with BackgroundServer(tiny_split / "cloud", limits=ServerLimits(kv_budget_bytes=3 * BLOCK_BYTES)) as server:
        edge = Edge(tiny_split / "edge", server.url, EdgeConfig(wire_dtype="fp32", cloud_key=server.fingerprint))
        try:
            assert edge.client.info.limits.kv_budget_entries == 3 * BLOCK_SIZE
            t0 = time.monotonic()
            with pytest.raises(CloudError) as e:
                edge.generate(list(range(3, 3 + 3 * BLOCK_SIZE)), max_new_tokens=2)
            assert e.value.code == ErrorCode.EXCEEDS_BUDGET and time.monotonic() - t0 < 1.0
            with pytest.raises(CloudError) as e:  # the prompt fits, prompt + answer does not
                edge.generate(GenerationRequest(list(range(3, 3 + 2 * BLOCK_SIZE)), 3 * BLOCK_SIZE, stop_at_eos=False))
            assert e.value.code == ErrorCode.EXCEEDS_BUDGET and server.server.stats.preemptions == 0
            api = EdgeAPI(edge, APIConfig(model_name="tiny", spec="none"))
            body = {"model": "tiny", "prompt": list(range(3, 3 + 3 * BLOCK_SIZE)), "max_tokens": 2}
            with serving(api.app) as url:
                req = urllib.request.Request(
                    url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
                )
                with pytest.raises(urllib.error.HTTPError) as http:
                    urllib.request.urlopen(req, timeout=30)
                err = json.loads(http.value.read())["error"]
                assert http.value.code == 400 and err["code"] == "cloud_budget_exceeded"
        finally:
            edge.close()
