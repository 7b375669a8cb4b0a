"""serve-edge's vLLM-style metrics: a request's way through the workers (waiting, running, queue
time), and real requests over a tiny model moving the token and speculative-decoding counters
consistently with what the responses say."""

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client import generate_latest

from conftest import scrape_metrics, serving
from splitlm.decoding.speculative import SpecStats
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.api import APIConfig, EdgeAPI
from splitlm.edge.api_metrics import EdgeMetrics

uvicorn = pytest.importorskip("uvicorn")


def values(metrics: EdgeMetrics) -> dict[str, float]:
    return scrape_metrics(generate_latest(metrics.registry).decode())


def test_a_request_waits_then_runs_and_a_cancelled_one_waits_no_more():
    m = EdgeMetrics()
    a, b = m.arrived(), m.arrived()
    assert values(m)["splitlm_edge_num_requests_waiting"] == 2
    time.sleep(0.01)
    m.started(a)
    v = values(m)
    assert v["splitlm_edge_num_requests_waiting"] == 1 and v["splitlm_edge_num_requests_running"] == 1
    assert v["splitlm_edge_request_queue_time_seconds_count"] == 1 and a.queue_s >= 0.01
    m.left(b)  # cancelled before a worker took it
    m.left(a)  # done: it no longer waited
    m.ended()
    v = values(m)
    assert v["splitlm_edge_num_requests_waiting"] == 0 and v["splitlm_edge_num_requests_running"] == 0
    m.started(b)  # a worker that took it as its job was being cancelled: counted once
    assert values(m)["splitlm_edge_num_requests_waiting"] == 0


def test_spec_stats_count_drafts_by_position():
    s = SpecStats()
    for nodes, accepted in [(5, 3), (1, 0), (4, 1), (6, 0)]:
        s.verified(nodes, accepted)
    assert (s.steps, s.drafts, s.draft_tokens, s.accepted_drafts) == (4, 3, 12, 4)
    assert s.accepted_per_position == [2, 1, 1]


def complete(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        if not body.get("stream"):
            return json.loads(r.read())["usage"]
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
        return next(json.loads(e)["usage"] for e in reversed(events) if e != "[DONE]" and '"usage"' in e)


def test_real_requests_move_the_counters_consistently(tiny_split, tiny_server):
    edge = Edge(tiny_split / "edge", tiny_server.url, EdgeConfig(wire_dtype="fp32", cloud_key=tiny_server.fingerprint))
    api = EdgeAPI(edge, APIConfig(model_name="tiny", spec="ngram", max_concurrent=1))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [40, 41, 40, 41, 40]]
    try:
        with serving(api.app) as url, ThreadPoolExecutor(3) as pool:
            bodies = [{"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0} for p in prompts]
            bodies[1] |= {"stream": True, "stream_options": {"include_usage": True}}  # counted when the stream ends
            usages = list(pool.map(lambda b: complete(url, b), bodies))
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                v = scrape_metrics(r.read().decode())
    finally:
        api.close()
        edge.close()
    n = len(prompts)
    assert v["splitlm_edge_generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    assert v["splitlm_edge_prompt_tokens_total"] == sum(len(p) for p in prompts)
    assert v["splitlm_edge_num_requests_waiting"] == 0 and v["splitlm_edge_num_requests_running"] == 0
    for h in ("request_queue_time_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert v[f"splitlm_edge_{h}_count"] == n, h
    e2e = v['splitlm_edge_e2e_request_latency_seconds_sum{endpoint="/v1/completions"}']
    assert 0 < v["splitlm_edge_time_to_first_token_seconds_sum"] < e2e
    assert v["splitlm_edge_request_queue_time_seconds_sum"] < v["splitlm_edge_time_to_first_token_seconds_sum"]
    drafts = v["splitlm_edge_spec_decode_num_drafts_total"]
    proposed = v["splitlm_edge_spec_decode_num_draft_tokens_total"]
    accepted = v["splitlm_edge_spec_decode_num_accepted_tokens_total"]
    per_pos = [
        v[k] for k in sorted((k for k in v if "accepted_tokens_per_pos" in k), key=lambda k: int(k.split('"')[1]))
    ]
    decode_steps = v["splitlm_edge_round_trips_total"] - n  # one prefill round trip per (short) prompt
    assert 0 < drafts <= decode_steps and drafts <= proposed
    assert 0 < accepted <= proposed
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)  # depth p+1 needs depth p
    # every step adds its accepted drafts and one token of its own, the prefill one (the last step may be cut)
    assert v["splitlm_edge_generation_tokens_total"] <= n + decode_steps + accepted
