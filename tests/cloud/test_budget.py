"""The KV memory budget: sessions reserve what their caches allocate; beyond the budget, CAPACITY."""

import time

import pytest
import torch

from conftest import cloud_forward
from splitlm.cloud.budget import KVBudget
from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits
from splitlm.edge.api_requests import cloud_failure
from splitlm.model.shards import Manifest, load_cloud
from splitlm.transport.client import CloudClient, CloudError
from splitlm.transport.errors import ErrorCode
from splitlm.transport.messages import Control, Open


def test_bytes_per_entry_and_whole_blocks(tiny_split):
    budget = KVBudget.for_model(load_cloud(tiny_split / "cloud"), 10**6)
    assert budget.bytes_per_entry == 2 * 2 * 2 * 16 * 4  # k and v, 2 cloud layers, 2 KV heads, head dim 16, fp32
    assert budget.need(0) == budget.need(1) == budget.need(256) == 256 * 512
    assert budget.need(257) == 2 * 256 * 512 and budget.entries == 10**6 // 512
    assert KVBudget.for_model(load_cloud(tiny_split / "cloud")).budget_bytes > 0  # automatic


BLOCK_BYTES = 256 * 512  # one block of the tiny cloud's cache


def test_capacity_refuses_new_sessions_and_growth_and_frees_on_close(tiny_split):
    fp = Manifest.read(tiny_split / "edge", "edge").fingerprint
    limits = ServerLimits(kv_budget_bytes=3 * BLOCK_BYTES)
    with BackgroundServer(tiny_split / "cloud", limits=limits) as server:
        client = CloudClient(server.url, fp)
        try:
            sessions = [client.open(Open("fp32")).session for _ in range(3)]
            with pytest.raises(CloudError) as e:
                client.open(Open("fp32"))
            assert e.value.code == ErrorCode.CAPACITY
            h = torch.randn(300, 64)  # two blocks
            with pytest.raises(CloudError) as e:
                cloud_forward(client, sessions[0], h, list(range(300)), "fp32")
            assert e.value.code == ErrorCode.CAPACITY
            assert server.server.sessions.sessions[sessions[0]].cache.length == 0  # unchanged
            result = cloud_forward(client, sessions[1], h[:10], list(range(10)), "fp32")  # within its block
            assert result.cache_len == 10
            assert result.round_trip_s >= result.wait_s >= 0.0 and result.round_trip_s > 0.0  # the client's clock
            client.close_session(sessions[2])
            result = cloud_forward(client, sessions[0], h, list(range(300)), "fp32")
            assert result.tensors["hidden"].shape == (300, 64) and result.cache_len == 300
            assert server.server.sessions.kv_reserved == 3 * BLOCK_BYTES
            with pytest.raises(CloudError) as e:  # full again
                client.open(Open("fp32"))
            assert e.value.code == ErrorCode.CAPACITY
            none = sessions[1]
            client.close_session(none)
            none = client.open(Open("fp32", "none")).session  # keeps nothing between requests: one block reserved
            cloud_forward(client, none, h[:5], list(range(5)), "fp32", control=Control(cache=False))
            assert server.server.sessions.sessions[none].kv_reserved == BLOCK_BYTES
            text = server.server.metrics.render().decode()
            assert "splitlm_cloud_kv_budget_bytes" in text and "splitlm_cloud_kv_reserved_bytes" in text
        finally:
            client.close()
        deadline = time.monotonic() + 10
        while server.server.sessions.sessions and time.monotonic() < deadline:  # dropped with the connection
            time.sleep(0.05)
        assert server.server.sessions.kv_reserved == 0


def test_the_local_api_answers_503_with_retry_after_at_capacity():
    full = cloud_failure(CloudError("full", ErrorCode.CAPACITY))
    assert full.status == 503 and full.code == "cloud_capacity" and int(full.headers["Retry-After"]) > 0
    assert cloud_failure(CloudError("gone")).status == 502
