"""The one writer of result files: stamped names, no overwrites, the Markdown and plots next to the JSON."""

from __future__ import annotations

import json

from splitlm.result_files import result_base, suffixed, time_stamp, write_json, write_result


def test_a_stamped_base_is_named_from_created_and_makes_the_directory(tmp_path):
    out = tmp_path / "a" / "b"
    base = result_base(out, "prefill", time_stamp("2025-01-02T03:04:05+0000"))
    assert base == out / "prefill-20250102-030405" and out.is_dir()


def test_two_runs_in_the_same_second_get_distinct_names(tmp_path):
    created = "2025-01-02T03:04:05+0000"
    first = write_json(suffixed(result_base(tmp_path, "bench", time_stamp(created)), ".json"), {"run": 1})
    second = write_json(suffixed(result_base(tmp_path, "bench", time_stamp(created)), ".json"), {"run": 2})
    third = suffixed(result_base(tmp_path, "bench", time_stamp(created)), ".json")
    assert [first.name, second.name, third.name] == [
        "bench-20250102-030405.json", "bench-20250102-030405-2.json", "bench-20250102-030405-3.json"]
    assert json.loads(first.read_text()) == {"run": 1} and json.loads(second.read_text()) == {"run": 2}


def test_a_dot_in_the_prefix_is_kept(tmp_path):
    base = result_base(tmp_path, "pass-cost-tinyllama-1.1b-cpu", time_stamp("2025-01-02T03:04:05+0000"))
    assert suffixed(base, ".json").name == "pass-cost-tinyllama-1.1b-cpu-20250102-030405.json"


def test_write_result_writes_json_plots_markdown_and_the_latest_copy(tmp_path):
    def plots(base):
        png = base.with_name(base.name + "-overview.png")
        png.write_bytes(b"png")
        return [png]

    written = write_result(tmp_path / "out", "bench", {"run": 1}, stamp="20250102-030405", plots=plots,
                           markdown=lambda pngs: "# report\n" + "".join(f"![x]({p.name})\n" for p in pngs),
                           latest="results.json")
    assert [p.name for p in written.paths] == [
        "bench-20250102-030405.json", "bench-20250102-030405.md", "bench-20250102-030405-overview.png"]
    assert written.markdown.read_text() == "# report\n![x](bench-20250102-030405-overview.png)\n"
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == {"run": 1}


def test_write_result_without_a_stamp_rewrites_its_fixed_names(tmp_path):
    first = write_result(tmp_path, "audit", {"run": 1}, markdown="a", markdown_name="report.md")
    second = write_result(tmp_path, "audit", {"run": 2}, markdown="b", markdown_name="report.md")
    assert first.paths == second.paths == [tmp_path / "audit.json", tmp_path / "report.md"]
    assert json.loads((tmp_path / "audit.json").read_text()) == {"run": 2}
    assert (tmp_path / "report.md").read_text() == "b"
