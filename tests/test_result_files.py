"""The one writer of result files: stamped names, no overwrites, the Markdown and plots next to the JSON,
and every result's provenance (commit, dirty tree, draft heads, machine, load, command)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from splitlm import result_files
from splitlm.result_files import (
    begin_run,
    note_head,
    result_base,
    suffixed,
    time_stamp,
    write_json,
    write_result,
)


def without_provenance(path) -> dict:
    doc = json.loads(path.read_text())
    assert doc.pop("provenance")["schema"] == "splitlm.provenance/1"
    return doc


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
        "bench-20250102-030405.json",
        "bench-20250102-030405-2.json",
        "bench-20250102-030405-3.json",
    ]
    assert json.loads(first.read_text()) == {"run": 1} and json.loads(second.read_text()) == {"run": 2}


def test_a_dot_in_the_prefix_is_kept(tmp_path):
    base = result_base(tmp_path, "pass-cost-tinyllama-1.1b-cpu", time_stamp("2025-01-02T03:04:05+0000"))
    assert suffixed(base, ".json").name == "pass-cost-tinyllama-1.1b-cpu-20250102-030405.json"


def test_write_result_writes_json_plots_markdown_and_the_latest_copy(tmp_path):
    def plots(base):
        png = base.with_name(base.name + "-overview.png")
        png.write_bytes(b"png")
        return [png]

    written = write_result(
        tmp_path / "out",
        "bench",
        {"run": 1},
        stamp="20250102-030405",
        plots=plots,
        markdown=lambda pngs: "# report\n" + "".join(f"![x]({p.name})\n" for p in pngs),
        latest="results.json",
    )
    assert [p.name for p in written.paths] == [
        "bench-20250102-030405.json",
        "bench-20250102-030405.md",
        "bench-20250102-030405-overview.png",
    ]
    assert written.markdown.read_text() == "# report\n![x](bench-20250102-030405-overview.png)\n"
    assert without_provenance(tmp_path / "out" / "results.json") == {"run": 1}


def test_write_result_without_a_stamp_rewrites_its_fixed_names(tmp_path):
    first = write_result(tmp_path, "audit", {"run": 1}, markdown="a", markdown_name="report.md")
    second = write_result(tmp_path, "audit", {"run": 2}, markdown="b", markdown_name="report.md")
    assert first.paths == second.paths == [tmp_path / "audit.json", tmp_path / "report.md"]
    assert without_provenance(tmp_path / "audit.json") == {"run": 2}
    assert (tmp_path / "report.md").read_text() == "b"


def test_a_result_records_commit_heads_machine_load_and_command(tmp_path):
    import torch

    head = tmp_path / "heads" / "m.safetensors"
    head.parent.mkdir()
    head.write_bytes(b"weights")
    head.with_suffix(".json").write_text("{}")
    begin_run(["splitlm", "bench", "--prompts", "a b.json"])
    note_head(head)
    written = write_result(tmp_path, "bench", {"run": 1}, stamp="20250102-030405")
    prov = json.loads(written.json.read_text())["provenance"]
    code = prov["code"]
    assert len(code["commit"]) == 40 and isinstance(code["dirty"], bool)  # this checkout
    assert code["dirty"] == bool(code["dirty_files"])
    assert prov["draft_heads"] == [
        {
            "path": str(head.resolve()),
            "sha256": hashlib.sha256(b"weights").hexdigest(),
            "report": str(head.with_suffix(".json").resolve()),
        }
    ]
    assert prov["machine"]["cpu"] and prov["machine"]["cores"] == os.cpu_count()
    assert prov["torch_threads"] == torch.get_num_threads()
    assert len(prov["load_avg"]["start"]) == len(prov["load_avg"]["end"]) == 3
    assert prov["command"] == ["splitlm", "bench", "--prompts", "a b.json"]
    assert prov["command_line"] == "splitlm bench --prompts 'a b.json'"
    begin_run(["next"])  # a new run forgets the heads of the last one
    assert result_files.provenance()["draft_heads"] == []


def test_a_result_records_the_code_as_its_run_started(monkeypatch):
    """A tree edited (or a commit made) while a long run goes on does not change what the run records."""
    state = {"commit": "a" * 40, "dirty": False, "dirty_files": [], "version": "0"}
    monkeypatch.setattr(result_files, "code_state", lambda: dict(state))
    begin_run(["splitlm", "bench"])
    state.update(commit="b" * 40, dirty=True, dirty_files=["src/splitlm/x.py"])
    assert result_files.provenance()["code"] == {"commit": "a" * 40, "dirty": False, "dirty_files": [], "version": "0"}


def git(repo, *args):
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True, capture_output=True
    )


def test_a_dirty_tree_is_flagged(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "a.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    monkeypatch.setattr(result_files, "SOURCE_ROOT", repo)
    clean = result_files.code_state()
    assert clean["dirty"] is False and len(clean["commit"]) == 40
    (repo / "notes.txt").write_text("an untracked file outside src/ leaves the code as committed")
    assert result_files.code_state()["dirty"] is False
    (repo / "src" / "b.py").write_text("y = 2\n")  # new code
    assert result_files.code_state()["dirty_files"] == ["src/b.py"]
    (repo / "src" / "b.py").unlink()
    (repo / "src" / "a.py").write_text("x = 2\n")
    state = result_files.code_state()
    assert state["dirty"] is True and state["dirty_files"] == ["src/a.py"] and state["commit"] == clean["commit"]


def test_outside_a_checkout_the_version_stands_for_the_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(result_files, "SOURCE_ROOT", tmp_path)
    state = result_files.code_state()
    assert state["commit"] is None and state["dirty"] is None and state["version"]


@pytest.mark.parametrize("writer", ["failover", "scale-out"])
def test_benchmark_scripts_write_through_write_result(writer):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = {
        "failover": root / "src" / "splitlm" / "bench" / "failover.py",
        "scale-out": root / "benchmarks" / "scale_out_capacity.py",
    }[writer].read_text()
    assert "write_result(" in source and "begin_run(" in source and "json.dump(" not in source
