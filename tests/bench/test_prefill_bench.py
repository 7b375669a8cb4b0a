"""`splitlm bench --prefill`: the bound, the summary and the report (the run itself is the benchmark)."""

import pytest

from splitlm import SplitLMError
from splitlm.bench.prefill import markdown, parse_list, pipeline_bound, stage_totals, summarise


def test_bound_is_the_slowest_stage_plus_one_chunk_through_the_others():
    stages = stage_totals(edge_s=1.0, cloud_s=6.0, bytes_up=2_500_000, bytes_down=2_500_000, mbps=100)
    assert stages["uplink"] == pytest.approx(0.2) and stages["downlink"] == pytest.approx(0.2)
    bound, slowest = pipeline_bound(stages, chunks=4, rtt_s=0.08)
    assert slowest == "cloud" and bound == pytest.approx(6.0 + (1.0 + 0.2 + 0.2) / 4 + 0.08)
    bound, slowest = pipeline_bound(stage_totals(1.0, 1.0, 25_000_000, 1000, 10), chunks=10, rtt_s=0.08)
    assert slowest == "uplink" and bound == pytest.approx(20.0 + (1.0 + 1.0 + 0.0008) / 10 + 0.08)


def row(mode, ttft, bound, tokens=(1, 2)):
    return {
        "mode": mode,
        "mbps": 100.0,
        "tokens_in": 2048,
        "ttft_s": ttft,
        "bound_s": bound,
        "chunk": 256,
        "chunks": 8,
        "slowest": "cloud",
        "tokens": list(tokens),
        "rtt_s": 0.08,
        "stages_s": {"edge": 0.8, "uplink": 0.2, "cloud": bound - 1.08, "downlink": 0.2},
    }


def test_summary_takes_medians_and_compares_tokens():
    rows = [
        row("unchunked", 10.0, 9.9),
        row("streamed", 8.0, 7.5),
        row("unchunked", 12.0, 11.9),
        row("streamed", 9.0, 7.7),
        row("unchunked", 11.0, 11.0),
        row("streamed", 8.5, 7.6),
    ]
    (s,) = summarise(rows)
    assert s["streamed_ttft_s"] == 8.5 and s["unchunked_ttft_s"] == 11.0 and s["bound_s"] == 7.6
    assert s["streamed_over_bound"] == round(8.5 / 7.6, 3) and s["speedup"] == round(11.0 / 8.5, 3)
    assert s["tokens_match"]
    assert s["bound_from_unchunked_work_s"] == pytest.approx(11.0 - 1.08 + (0.8 + 0.2 + 0.2) / 8 + 0.08)
    assert not summarise([row("unchunked", 1, 1), row("streamed", 1, 1, tokens=(1, 3))])[0]["tokens_match"]
    doc = {
        "created": "now",
        "summary": [s],
        "config": {"head": 2, "tail": 2, "rtt_ms": 80, "repeats": 3},
        "environment": {
            "model": "m",
            "wire_dtype": "fp16",
            "cpu_count": 2,
            "load_avg_at_start": [1],
            "load_avg_at_end": [2],
        },
    }
    assert (
        "| 100 | 2048 | 11000 ms | 8500 ms | 7600 ms | 1.12 | 1.29× | 8 × 256 | cloud | 10150 ms | yes |"
        in markdown(doc)
    )


def test_bad_lists_are_refused():
    assert parse_list("64, 128", "--prefill-lengths", int) == [64, 128]
    for bad in ("", "64,x", "0,10"):
        with pytest.raises(SplitLMError, match="--prefill-lengths"):
            parse_list(bad, "--prefill-lengths", int)
