"""Prefix reuse through serve-edge's API and the official `openai` client, on a tiny chat model: a
4-turn conversation and a shared system prompt equal the same requests sent cold, `cached_tokens`
in the usage, `extra_body` cache policies, a cancelled stream and its retry, metrics and the log line."""

import contextlib
import logging
import time
import urllib.request

import pytest

from conftest import scrape_metrics, serving
from splitlm.bench.wan import WanConfig, WanEmulator
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.api import APIConfig, EdgeAPI
from splitlm.edge.api_log import RequestLog
from splitlm.edge.prefix_pool import PoolLimits

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"
TURNS = ["abc abc abc", "cab cab", "a b c a b c", "ccc bbb aaa"]


@contextlib.contextmanager
def serving_client(app):
    """The API behind `RequestLog` on a free port; an `openai` client of it."""
    with serving(RequestLog(app)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def cloud(tiny_chat_split):
    from splitlm.cloud.server import BackgroundServer

    with BackgroundServer(tiny_chat_split / "cloud") as server:
        yield server


@pytest.fixture(scope="module")
def clients(tiny_chat_split, cloud):
    """(reusing, cold): two servers over one edge, with and without the pool."""
    with Edge(tiny_chat_split / "edge", cloud.url, EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint)) as edge:
        apis = [
            EdgeAPI(edge, APIConfig(model_name=MODEL, spec="ngram", prefix_pool=PoolLimits(ttl_s=0))),
            EdgeAPI(edge, APIConfig(model_name=MODEL, spec="ngram", prefix_pool=PoolLimits(sessions=0))),
        ]
        try:
            with serving_client(apis[0].app) as warm, serving_client(apis[1].app) as cold:
                yield warm, cold, apis[0]
        finally:
            for api in apis:
                api.close()


def chat(client, messages, stream=False, **kwargs):
    """(text, usage) of a greedy chat completion, streamed (usage from the last chunk) or not."""
    args = dict(model=MODEL, messages=messages, temperature=0, **{"max_tokens": 12, **kwargs})
    if not stream:
        reply = client.chat.completions.create(**args)
        return reply.choices[0].message.content, reply.usage
    text, usage = [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        usage = chunk.usage or usage
        text += [c.delta.content or "" for c in chunk.choices]
    return "".join(text), usage


def metrics(api) -> dict:
    from prometheus_client import generate_latest

    return scrape_metrics(generate_latest(api.metrics.registry).decode())


def test_a_four_turn_conversation_reused_equals_cold(clients, caplog):
    warm, cold, api = clients
    messages, cached = [{"role": "system", "content": "be brief"}], []
    with caplog.at_level(logging.INFO, logger="splitlm.edge.api_log"):
        for i, turn in enumerate(TURNS):
            messages.append({"role": "user", "content": turn})
            text, usage = chat(warm, messages, stream=i % 2 == 1)  # the usage chunk of a stream too
            want, cold_usage = chat(cold, messages)
            assert text == want
            assert cold_usage.prompt_tokens_details.cached_tokens == 0
            assert usage.prompt_tokens == cold_usage.prompt_tokens
            cached.append(usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": text})
    assert cached[0] == 0
    # each later turn reuses the turns before it (up to where the re-rendered answer's ids part)
    lengths = [len(m["content"]) for m in messages]
    assert all(cached[i] > sum(lengths[: 2 * i]) for i in range(1, 4)), cached
    v = metrics(api)
    assert v["splitlm_edge_prefix_cache_hits_total"] == sum(cached)
    assert v["splitlm_edge_prefix_cache_queries_total"] >= sum(cached) + 4
    assert v["splitlm_edge_prefix_pool_sessions"] >= 1 and v['splitlm_edge_prefix_pool_bytes{side="cloud"}'] > 0
    lines = [r.getMessage() for r in caplog.records if "POST /v1/chat/completions 200" in r.getMessage()]
    assert any(line.endswith(f", {cached[-1]} reused") for line in lines), lines


def test_a_shared_system_prompt_serves_two_conversations(clients):
    warm, cold, _ = clients
    system = {"role": "system", "content": "You answer in lowercase letters only, and never more than ten words."}
    first = [system, {"role": "user", "content": "abab"}]
    second = [system, {"role": "user", "content": "cdcd"}]
    chat(warm, first)
    text, usage = chat(warm, second)
    assert text == chat(cold, second)[0]
    assert usage.prompt_tokens_details.cached_tokens >= len(system["content"])  # byte-level: a token per byte


def test_extra_body_cache_policy(clients):
    warm, cold, api = clients
    messages = [{"role": "user", "content": "none of it may stay"}]
    chat(warm, messages)
    hits = metrics(api)["splitlm_edge_prefix_cache_hits_total"]
    text, usage = chat(warm, messages, extra_body={"cache_policy": "none"})
    assert usage.prompt_tokens_details.cached_tokens == 0 and text == chat(cold, messages)[0]
    assert metrics(api)["splitlm_edge_prefix_cache_hits_total"] == hits
    for policy, words in (("window:x", "window:N needs an integer"), ("public", "unknown cache policy")):
        with pytest.raises(openai.BadRequestError) as e:
            chat(warm, messages, extra_body={"cache_policy": policy})
        assert e.value.response.json()["error"]["param"] == "cache_policy" and words in str(e.value)


def test_a_request_may_not_loosen_the_server_policy(tiny_chat_split, cloud):
    with Edge(
        tiny_chat_split / "edge",
        cloud.url,
        EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint, cache_policy="none"),
    ) as edge:
        api = EdgeAPI(edge, APIConfig(model_name=MODEL, spec="ngram"))
        try:
            with serving_client(api.app) as client:
                messages = [{"role": "user", "content": "abc"}]
                for _ in range(2):
                    assert chat(client, messages)[1].prompt_tokens_details.cached_tokens == 0
                with pytest.raises(openai.BadRequestError) as e:
                    chat(client, messages, extra_body={"cache_policy": "session"})
                assert "looser than this server's (none)" in str(e.value)
                assert api.pool.usage().sessions == 0
        finally:
            api.close()


def test_a_cancelled_stream_then_a_retry(tiny_chat_split, cloud):
    """The client drops a stream mid-way (over a 40 ms link, so that it is mid-way): the state keeps
    the prompt and nothing of the half-finished answer; the retry reuses it and equals cold."""
    with (
        WanEmulator(upstream=("127.0.0.1", cloud.server.port), config=WanConfig(rtt_ms=40)) as wan,
        Edge(
            tiny_chat_split / "edge", wan.url_for("ws"), EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint)
        ) as edge,
    ):
        api = EdgeAPI(edge, APIConfig(model_name=MODEL, spec="none", prefix_pool=PoolLimits(ttl_s=0)))
        messages = [{"role": "user", "content": "count: a b c d e f g h"}]
        ids = edge.text.encode_messages(messages)
        try:
            with serving_client(api.app) as client:
                stream = client.chat.completions.create(
                    model=MODEL, messages=messages, temperature=0, max_tokens=400, stream=True
                )
                for _, _chunk in zip(range(4), stream, strict=False):
                    pass
                stream.close()
                deadline = time.monotonic() + 20
                while (
                    api.pool.usage().sessions == 0 or metrics(api)["splitlm_edge_num_requests_running"]
                ) and time.monotonic() < deadline:
                    time.sleep(0.05)
                [entry] = api.pool.entries
                assert entry.ids == ids and entry.session.length == len(ids)  # cancelled: the prompt, no answer
                text, usage = chat(client, messages, max_tokens=16)
                assert usage.prompt_tokens_details.cached_tokens == len(ids) - 1
                assert text == edge.generate(ids, 16, spec="none").text
        finally:
            api.close()


def test_usage_in_the_completions_route(clients):
    warm, cold, _ = clients
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    first = warm.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
    again = warm.completions.create(model=MODEL, prompt=prompt + [13], temperature=0, max_tokens=6)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt)
    assert (
        again.choices[0].text
        == cold.completions.create(model=MODEL, prompt=prompt + [13], temperature=0, max_tokens=6).choices[0].text
    )
    with urllib.request.urlopen(
        urllib.request.Request(str(warm.base_url).rstrip("/").rsplit("/v1", 1)[0] + "/metrics"), timeout=10
    ) as r:
        assert "splitlm_edge_prefix_cache_hits_total" in r.read().decode()
