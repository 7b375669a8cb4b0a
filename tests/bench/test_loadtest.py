"""`splitlm loadtest` on the tiny model: both configurations run, every session equals its single-session output."""

import json

from splitlm.bench.load_sessions import percentile
from splitlm.bench.loadtest import LoadConfig, markdown, run_loadtest
from splitlm.cli import main
from splitlm.cloud.server import BackgroundServer
from splitlm.cloud.sessions import ServerLimits


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile(list(range(101)), 99) == 99


def test_loadtest_batched_and_baseline(tiny_split):
    doc = run_loadtest(
        LoadConfig(
            sessions=3,
            max_new_tokens=6,
            rtt_ms=20,
            max_batch=4,
            prefill_tokens=40,
            prefill_chunk=16,
            edge=str(tiny_split / "edge"),
        )
    )
    batched, single = doc["configurations"]
    assert (batched["name"], single["name"]) == ("batched", "max-batch-1")
    assert single["cloud_args"][:4] == ["--max-batch", "1", "--prefill-chunk", "16"]
    for r in doc["configurations"]:
        assert r["errors"] == 0 and r["identical_outputs"] == r["sessions"] == 3 and r["tokens"] == 18
        assert r["step_latency_ms"]["p50"] >= 20 * 0.9  # at least the emulated round trip
        assert r["step_latency_ms"]["p50"] <= r["step_latency_ms"]["p95"] <= r["step_latency_ms"]["p99"]
        assert r["per_session_tok_s"] > 0 and r["ttft_s"]["p50"] > 0
        p = r["prefill_interference"]
        assert p["prefill_tokens"] == 40 and p["prefill_error"] is None and p["errors"] == 0
        assert p["chunk_tokens"] == 16 and p["chunk_compute_ms"] > 0
    for key in (
        "sessions",
        "aggregate_tok_s",
        "per_session_tok_s",
        "step_latency_ms",
        "ttft_s",
        "errors",
        "identical_outputs",
    ):
        assert doc[key] == batched[key], key
    assert doc["speedup"] > 0
    assert "| batched | 3 |" in markdown(doc)


def test_loadtest_against_a_running_cloud_prints_json(tiny_split, tmp_path, capsys):
    with BackgroundServer(tiny_split / "cloud") as server:
        rc = main(
            [
                "loadtest",
                "--edge",
                str(tiny_split / "edge"),
                "--cloud",
                server.url,
                "--sessions",
                "2",
                "--max-new-tokens",
                "3",
                "--rtt-ms",
                "10",
                "--prefill-tokens",
                "0",
                "--out",
                str(tmp_path),
                "--json",
            ]
        )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "splitlm.loadtest/1" and doc["identical_outputs"] == 2 and doc["errors"] == 0
    assert [c["name"] for c in doc["configurations"]] == ["cloud"] and "speedup" not in doc
    (path,) = tmp_path.glob("loadtest-*.json")
    assert json.loads(path.read_text())["sessions"] == 2


def test_loadtest_keeps_the_callers_thread_count(tiny_split):
    import torch

    before = torch.get_num_threads()
    run_loadtest(LoadConfig(sessions=1, max_new_tokens=2, rtt_ms=0, prefill_tokens=0, edge=str(tiny_split / "edge")))
    assert torch.get_num_threads() == before


def test_loadtest_spreads_sessions_over_client_keys_and_a_prompt_beyond_the_budget_is_refused_at_once(tiny_split):
    """A cloud that allows 2 sessions per client and whose KV budget (320 entries) is below one full
    context: 5 sessions all finish, each equal to its solo output; a 400-token prompt gets
    EXCEEDS_BUDGET within a second."""
    limits = ServerLimits(max_sessions_per_client=2, kv_budget_bytes=320 * 512)
    with BackgroundServer(tiny_split / "cloud", limits=limits) as server:
        doc = run_loadtest(
            LoadConfig(
                sessions=5,
                max_new_tokens=6,
                rtt_ms=10,
                prefill_tokens=400,
                prefill_chunk=64,
                edge=str(tiny_split / "edge"),
                cloud=server.url,
            )
        )
    assert doc["errors"] == 0 and doc["identical_outputs"] == 5 and doc["client_keys"] == 3
    p = doc["prefill_interference"]
    assert "EXCEEDS_BUDGET" in p["prefill_error"] and p["prefill_error_after_s"] < 1.0 and p["errors"] == 0
