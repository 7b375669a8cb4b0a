"""Virtual edges (`splitlm.bench.virtual`) and the capacity curve (`splitlm.bench.capacity`) on the tiny model:
a recorded trace replays with the same pass shapes, and a 2-point curve runs without errors."""

from __future__ import annotations

import json
import threading

import pytest

from splitlm.bench.capacity import CapacityConfig, model_facts, prompt_ids, run_capacity
from splitlm.bench.capacity_report import markdown, write_capacity
from splitlm.bench.trace import Trace, record_trace
from splitlm.bench.virtual import Target, VirtualEdge, prepare, random_hidden
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.runtime import as_spec
from splitlm.transport.client import CloudClient


@pytest.fixture(scope="module")
def recorded(tiny_split, tmp_path_factory):
    """(trace of 3 tiny-model generations with --spec auto, its file, the server's forwards and tokens while
    recording)."""
    from splitlm.cloud.server import BackgroundServer

    edge_dir = tiny_split / "edge"
    prompts = prompt_ids(edge_dir, "", 256)[:3]
    with (
        BackgroundServer(tiny_split / "cloud") as server,
        Edge(edge_dir, server.url, EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32")) as edge,
    ):
        stats = server.server.stats
        before = (stats.forwards, stats.tokens)
        trace = record_trace(edge, prompts, as_spec("auto"), 10, 0.0)
        counts = (stats.forwards - before[0], stats.tokens - before[1])
    path = trace.save(tmp_path_factory.mktemp("trace") / "tiny.json")
    return trace, path, counts


def test_a_trace_round_trips_through_its_file(recorded):
    trace, path, _ = recorded
    again = Trace.load(path)
    assert again == trace
    assert [p.tokens for p in trace.prompts] == [10, 10, 10]  # every token the edge produced is credited
    steps = [s for p in trace.prompts for s in p.steps]
    assert any(s.mask is not None for s in steps), "auto should have sent at least one tree"
    assert all(s.rows == len(s.positions) for s in steps)


def test_virtual_edges_replay_the_recorded_pass_shapes(tiny_split, recorded):
    """The real cloud accepts the random activations and sees the recorded run's rows, keeps and crops:
    the same forwards, token rows and cache length after every step."""
    from splitlm.cloud.server import BackgroundServer

    trace, _, (forwards, tokens) = recorded
    fingerprint, hidden, _, split = model_facts(tiny_split / "edge")
    with BackgroundServer(tiny_split / "cloud") as server:
        target = Target(server.url, fingerprint, hidden, split)
        edge = VirtualEdge(target, trace, prepare(trace), random_hidden(trace, hidden), 0, threading.Event())
        client = CloudClient(server.url, fingerprint)
        try:
            for prompt, steps in zip(trace.prompts, edge.prepared, strict=True):
                edge.replay(client, prompt, steps)
        finally:
            client.close()
        assert (server.server.stats.forwards, server.server.stats.tokens) == (forwards, tokens)
        assert server.server.stats.errors == 0
    recorded_steps = [s for p in trace.prompts for s in p.steps]
    samples = edge.log.samples
    assert [s.rows for s in samples] == [s.rows for s in recorded_steps]
    assert [s.cache_len for s in samples] == [s.cache_len for s in recorded_steps]
    assert sum(s.accepted for s in samples) == 30 and edge.log.generations == 3 and not edge.log.errors
    assert [s.prefill for s in samples] == [i == 0 for p in trace.prompts for i in range(len(p.steps))]


def test_a_two_point_capacity_curve(tiny_split, recorded, tmp_path):
    _, path, _ = recorded
    config = CapacityConfig(
        sessions=[1, 3],
        rtt_ms=20,
        seconds=1.0,
        warmup_s=0.3,
        max_batch=4,
        edge=str(tiny_split / "edge"),
        trace=str(path),
        out=str(tmp_path),
    )
    doc = run_capacity(config)
    assert doc["schema"] == "splitlm.capacity/1" and [p["sessions"] for p in doc["curve"]] == [1, 3]
    for point in doc["curve"]:
        for side in ("batched", "unbatched"):
            r = point[side]
            assert r["errors"] == 0 and r["cloud_errors"] == 0, r["error_messages"]
            assert r["aggregate_tok_s"] > 0 and r["forwards"] > 0 and r["passes_s"] > 0
            assert r["step_latency_ms"]["p50"] >= 20  # the emulated RTT is part of a step
            assert r["step_latency_ms"]["p99"] >= r["step_latency_ms"]["p50"]
            assert r["decode_latency_ms"]["p50"] >= 20
            assert r["kv_bytes"] is not None and r["cloud_rss_mb"] > 0
        assert point["unbatched"]["sessions_per_pass"] == 1.0
    assert 0 < doc["client_cpu_share"] < 1
    paths = write_capacity(doc, tmp_path)
    assert sorted(p.suffix for p in paths) == [".json", ".md", ".png"]
    assert json.loads(paths[0].read_text())["curve"] == doc["curve"]
    assert "| 3 | batched |" in markdown(doc)
