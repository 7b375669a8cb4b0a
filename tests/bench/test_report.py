from __future__ import annotations

import json

from splitlm.bench.report import stamped_base, suffixed, write_json


def test_stamped_base_names_from_created_and_makes_the_directory(tmp_path):
    out = tmp_path / "a" / "b"
    base = stamped_base(out, "prefill", "2025-01-02T03:04:05+0000")
    assert base == out / "prefill-20250102-030405" and out.is_dir()


def test_two_runs_in_the_same_second_get_distinct_names(tmp_path):
    created = "2025-01-02T03:04:05+0000"
    first = write_json(suffixed(stamped_base(tmp_path, "bench", created), ".json"), {"run": 1})
    second = write_json(suffixed(stamped_base(tmp_path, "bench", created), ".json"), {"run": 2})
    third = suffixed(stamped_base(tmp_path, "bench", created), ".json")
    assert [first.name, second.name, third.name] == [
        "bench-20250102-030405.json", "bench-20250102-030405-2.json", "bench-20250102-030405-3.json"]
    assert json.loads(first.read_text()) == {"run": 1} and json.loads(second.read_text()) == {"run": 2}


def test_a_dot_in_the_prefix_is_kept(tmp_path):
    base = stamped_base(tmp_path, "pass-cost-tinyllama-1.1b-cpu", "2025-01-02T03:04:05+0000")
    assert suffixed(base, ".json").name == "pass-cost-tinyllama-1.1b-cpu-20250102-030405.json"
