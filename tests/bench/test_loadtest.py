"""`splitlm loadtest` on the tiny model: both configurations run, every session equals its single-session output."""

import json

from splitlm.bench.loadtest import LoadConfig, markdown, percentile, run_loadtest
from splitlm.cli import main


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile(list(range(101)), 99) == 99


def test_loadtest_batched_and_baseline(tiny_split):
    doc = run_loadtest(LoadConfig(sessions=3, max_new_tokens=6, rtt_ms=20, max_batch=4, prefill_tokens=40,
                                  edge=str(tiny_split / "edge")))
    batched, single = doc["results"]
    assert (batched["name"], single["name"]) == ("batched", "max-batch-1")
    for r in doc["results"]:
        assert r["errors"] == 0 and r["all_identical"] and r["tokens"] == 18
        assert r["step_p50_ms"] >= 20 * 0.9  # at least the emulated round trip
        p = r["prefill_interference"]
        assert p["prefill_tokens"] == 40 and p["prefill_error"] is None and p["errors"] == 0
    assert doc["speedup"] > 0
    assert "| batched | 3 |" in markdown(doc)


def test_loadtest_cli_writes_json(tiny_split, tmp_path, capsys):
    rc = main(["loadtest", "--edge", str(tiny_split / "edge"), "--sessions", "2", "--max-new-tokens", "3",
               "--rtt-ms", "0", "--prefill-tokens", "0", "--out", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("loadtest-*.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "splitlm.loadtest/1" and all(r["all_identical"] for r in doc["results"])
    assert "aggregate tok/s batched / max-batch 1" in capsys.readouterr().out
