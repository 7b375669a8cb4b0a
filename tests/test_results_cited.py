"""The committed benchmark runs are the ones the docs cite: every run cited exists, every run kept is cited.

A run is cited by its name, the file name up to its time stamp (`bench-20261202-111001`,
`loadtest-2026-12-01T110451`, `train-head-20261201-1308`; a link to its .md or .json contains it),
anywhere in README.md, docs/*.md or benchmarks/README.md. A run written under a fixed name
(`failover.json`, `split-head-d.json`, a directory such as `benchmarks/audit/`) is cited by its path.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_DIRS = ("benchmarks/results", "benchmarks/prefill", "benchmarks/edge-profiles")
# runs of fixed file names, one per directory
RUN_DIRS = ("benchmarks/audit", "benchmarks/audit/harden-k2", "benchmarks/audit-qwen")
STAMPED = r"[a-z][a-z0-9-]*?-(?:\d{8}-\d{4,6}|\d{4}-\d{2}-\d{2}T\d{6})(?:-\d)?"


def doc_text() -> str:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
    return "\n".join(p.read_text() for p in pages if p.is_file())


def cited_names(text: str) -> set[str]:
    return set(re.findall(rf"(?<![\w-])({STAMPED})(?!\d)", text))


def kept_runs() -> dict[str, list[Path]]:
    """Run name (or path, for fixed names) -> its files."""
    runs: dict[str, list[Path]] = {}
    for d in RESULT_DIRS:
        for f in sorted((ROOT / d).glob("*")):
            if f.is_file() and f.name != "results.json":  # bench's copy of its latest run (git-ignored)
                m = re.match(STAMPED, f.name)
                runs.setdefault(m.group(0) if m else f"{d}/{f.name}", []).append(f)
    for d in RUN_DIRS:
        if (ROOT / d).is_dir():
            runs[d + "/"] = [f for f in (ROOT / d).iterdir() if f.is_file()]
    return runs


def is_cited(name: str, text: str, names: set[str]) -> bool:
    if name.endswith("/"):  # a run directory: a path to a file in it (not in a directory below it)
        return re.search(re.escape(name) + r"[\w-]+(?:\.[\w-]+)*(?![\w/-])", text) is not None
    return name in names if "/" not in name else name in text


def test_the_citation_rule_reads_names_and_paths():
    text = (
        "see bench-20261202-111001 and (loadtest-2026-12-01T110451), benchmarks/results/failover.json, "
        "[x](../benchmarks/audit/report.md); not bench-2026120-1; prebench-20261202-1110019"
    )
    names = cited_names(text)
    assert names == {"bench-20261202-111001", "loadtest-2026-12-01T110451"}
    assert is_cited("benchmarks/results/failover.json", text, names)
    assert is_cited("benchmarks/audit/", text, names) and not is_cited("benchmarks/audit/harden-k2/", text, names)


def test_every_cited_run_exists_and_every_kept_run_is_cited():
    text = doc_text()
    names, runs = cited_names(text), kept_runs()
    missing = sorted(n for n in names if n not in runs)
    assert not missing, f"cited in the docs but not in {', '.join(RESULT_DIRS)}: {missing}"
    uncited = sorted(name for name in runs if not is_cited(name, text, names))
    assert not uncited, f"kept but cited nowhere (cite them in benchmarks/README.md or delete them): {uncited}"
