"""The figures the README and docs quote are the figures of their runs, and the README cites no run of a dirty tree.

`benchmarks/figures.json` lists the quoted figures, one entry each:

    {"id": "readme.headline.auto.tau", "doc": "README.md", "text": "**2.89** tokens per round trip",
     "number": "2.89", "run": "benchmarks/results/bench-20261204-144209.json",
     "path": ["results", {"mode": "auto", "category": "all"}, "tokens_per_round_trip"],
     "value": 2.8904..., "rule": "round:2"}

- `text` is the quoted text as written; it must appear in `doc` (whitespace runs count as one space), and
  `number` in it as a whole number (not part of a longer one). With `table` ({"after": a heading or any
  text before the table, "row": the first cell (or a list: the first cells), "column": the header cell})
  `text` must appear in that cell.
- `path` leads into the run's JSON: a key, a list index, or an object that picks the one list element
  whose fields have those values. With `over` (a second path) the figure is the ratio of the two values;
  with `tok_s_ratio_on_the_same_prompts` ({"mode", "category", "base"}; `path` leads to the bench's `runs`)
  it is the mode's tok/s over the base mode's on the same prompts (a bench's per-category table when
  modes ran on different numbers of questions); with `count_where` (an object, `path` leading to a list)
  it is the number of the list's elements whose fields have those values.
- `rule` says how the number was rounded: `round:N` (N decimals), `percent:N` (100 × the value) or
  `ms:N` (seconds quoted in milliseconds); the number must have N decimals and lie within half a unit
  of its last digit of the value.
- `value` is the value at the path when the entry was written: a rewritten run fails here too.

Reads JSON and Markdown only.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import cache
from pathlib import Path

import pytest

from test_results_cited import cited_names, kept_runs

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "benchmarks" / "figures.json"
SOURCE = re.compile(r"^(src/|benchmarks/.*\.(py|sh)$|Makefile$|pyproject\.toml$)")  # what a run executes
LISTED_AT_MOST = 20  # result_files.code_state lists this many dirty files


def load_figures(path: Path = FIGURES) -> list[dict]:
    return json.loads(path.read_text())["figures"]


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def at(doc, path: list):
    """The value at `path` in a JSON document (see the module's doc)."""
    for step in path:
        if isinstance(step, dict):
            picked = [x for x in doc if isinstance(x, dict) and all(x.get(k) == v for k, v in step.items())]
            if len(picked) != 1:
                raise LookupError(f"{step} picks {len(picked)} elements, not one")
            doc = picked[0]
        else:
            doc = doc[step]
    return doc


@cache
def read_json(path: Path, stamp: tuple[int, int]):
    return json.loads(path.read_text())


def run_json(path: Path):
    """A run's JSON, read once while the file is unchanged."""
    st = path.stat()
    return read_json(path, (st.st_mtime_ns, st.st_size))


def same_prompts_tok_s_ratio(runs: list[dict], mode: str, category: str, base: str) -> float:
    """`mode`'s tok/s (decoded tokens over decoding time) over `base`'s on the prompts `mode` ran."""

    def tok_s(rs: list[dict]) -> float:
        return sum(r["decode_tokens"] for r in rs) / sum(r["decode_s"] for r in rs)

    mine = [r for r in runs if r["mode"] == mode and category in ("all", r["category"])]
    ids = {r["prompt_id"] for r in mine}
    return tok_s(mine) / tok_s([r for r in runs if r["mode"] == base and r["prompt_id"] in ids])


def figure_value(entry: dict, root: Path) -> float:
    doc = run_json(root / entry["run"])
    value = at(doc, entry["path"])
    if "count_where" in entry:
        return sum(all(x.get(k) == v for k, v in entry["count_where"].items()) for x in value)
    if "tok_s_ratio_on_the_same_prompts" in entry:
        return same_prompts_tok_s_ratio(value, **entry["tok_s_ratio_on_the_same_prompts"])
    return value / at(doc, entry["over"]) if "over" in entry else value


def matches(number: str, value: float, rule: str) -> bool:
    """Whether `number` as written is `value` rounded by `rule`."""
    kind, _, digits = rule.partition(":")
    n = int(digits)
    written = number.split(".")[1] if "." in number else ""
    scale = {"round": 1, "percent": 100, "ms": 1000}.get(kind)
    if scale is None or len(written) != n:
        return False
    shown = value * scale
    return abs(float(number.replace(",", "").replace("−", "-")) - shown) <= 0.5 * 10**-n + 1e-9


def has_number(text: str, number: str) -> bool:
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", text) is not None


def table_cell(page: str, table: dict) -> str | None:
    """The cell of the first Markdown table after `table["after"]`, in row `row` and column `column`."""
    start = page.find(table.get("after", ""))
    if start < 0:
        return None
    lines = page[start:].splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if first is None:
        return None
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    header = rows[0]
    if table["column"] not in header:
        return None
    for row in rows[2:]:
        label = table["row"] if isinstance(table["row"], list) else [table["row"]]
        if row[: len(label)] == label:
            return row[header.index(table["column"])]
    return None


def problems(entry: dict, root: Path = ROOT) -> list[str]:
    """What is wrong with one figure: its text not in its doc, its number not its run's value."""
    out, name = [], entry["id"]
    page = (root / entry["doc"]).read_text()
    if "table" in entry:
        cell = table_cell(page, entry["table"])
        if cell is None:
            out.append(f"{name}: no cell {entry['table']} in {entry['doc']}")
        elif squash(entry["text"]) not in squash(cell):
            out.append(f"{name}: {entry['text']!r} is not in its cell of {entry['doc']}: {cell!r}")
    elif squash(entry["text"]) not in squash(page):
        out.append(f"{name}: {entry['text']!r} is not in {entry['doc']}")
    if not has_number(entry["text"], entry["number"]):
        out.append(f"{name}: {entry['number']!r} is not a number in {entry['text']!r}")
    try:
        value = figure_value(entry, root)
    except (OSError, LookupError, TypeError, ValueError) as e:
        return [*out, f"{name}: no value at {entry['path']} in {entry['run']}: {e!r}"]
    if abs(value - entry["value"]) > 1e-9 * max(1.0, abs(value)):
        out.append(f"{name}: {entry['run']} now holds {value}, the list says {entry['value']}")
    if not matches(entry["number"], value, entry["rule"]):
        out.append(f"{name}: {entry['doc']} quotes {entry['number']}, {entry['run']} holds {value} ({entry['rule']})")
    return out


def dirty_source(code: dict | None) -> bool:
    """Whether a run's `provenance.code` says its source tree had uncommitted changes (or cannot say)."""
    if not code or not code.get("commit") or code.get("dirty") is None:
        return True
    files = code.get("dirty_files") or []
    return len(files) >= LISTED_AT_MOST or any(SOURCE.match(f) for f in files)


@cache
def provenance_code(path: Path) -> dict | None:
    return (json.loads(path.read_text()).get("provenance") or {}).get("code")


def runs_cited_by(text: str) -> dict[str, list[Path]]:
    """The kept runs a page cites (by name, by fixed file name, by directory) -> their JSON files."""
    names = cited_names(text)
    cited = {}
    for run, files in kept_runs().items():
        fixed_name = run.rsplit("/", 1)[-1] if not run.endswith("/") else run
        if run in names or ("/" in run and (run in text or re.search(rf"(?<![\w-]){re.escape(fixed_name)}", text))):
            cited[run] = [f for f in files if f.suffix == ".json"]
    return cited


FIGURE_LIST = load_figures()


def test_the_list_is_well_formed():
    ids = [f["id"] for f in FIGURE_LIST]
    assert len(ids) == len(set(ids)), "duplicate ids"
    keys = {"id", "doc", "text", "number", "run", "path", "value", "rule"}
    assert all(keys <= set(f) for f in FIGURE_LIST)
    assert all((ROOT / f["doc"]).is_file() and (ROOT / f["run"]).is_file() for f in FIGURE_LIST)


@pytest.mark.parametrize("doc", sorted({f["doc"] for f in FIGURE_LIST}))
def test_every_quoted_figure_is_its_runs(doc: str):
    found = [p for f in FIGURE_LIST if f["doc"] == doc for p in problems(f)]
    assert not found, "\n".join(found)


def test_every_run_of_the_readme_headline_table_has_its_figures_checked():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Headline figures", 1)[1].split("\n### ", 1)[0]
    checked = {Path(f["run"]).stem for f in FIGURE_LIST if f["doc"] == "README.md"}
    cited = {Path(files[0]).stem for files in runs_cited_by(table).values() if files}
    assert cited and cited <= checked, f"cited in the headline table, no figure checked: {sorted(cited - checked)}"


def test_no_readme_figure_cites_a_run_from_a_dirty_source_tree():
    readme = (ROOT / "README.md").read_text()
    cited = runs_cited_by(readme)
    cited_files = {f for files in cited.values() for f in files}
    quoted = {ROOT / f["run"] for f in FIGURE_LIST if f["doc"] == "README.md" and f["run"].startswith("benchmarks/")}
    assert quoted and quoted <= cited_files, (
        f"quoted in the README, its run not named there: {sorted(quoted - cited_files)}"
    )
    dirty = sorted(
        run for run, files in cited.items() if not files or any(dirty_source(provenance_code(f)) for f in files)
    )
    assert not dirty, f"the README cites runs whose source tree was dirty (or that record no provenance): {dirty}"


def test_the_dirty_rule_reads_source_files_only():
    clean = {"commit": "f73ed34", "dirty": False, "dirty_files": []}
    assert not dirty_source(clean)
    assert not dirty_source({**clean, "dirty": True, "dirty_files": ["README.md", "docs/results.md"]})
    assert dirty_source({**clean, "dirty": True, "dirty_files": ["docs/x.md", "src/splitlm/bench/modes.py"]})
    assert dirty_source({**clean, "dirty": True, "dirty_files": ["benchmarks/gpu.sh"]})
    assert dirty_source({**clean, "dirty": True, "dirty_files": [f"docs/{i}.md" for i in range(20)]})  # cut off
    assert dirty_source(None) and dirty_source({"commit": None, "dirty": None})
    code = provenance_code(ROOT / "benchmarks/results/bench-20261205-002147.json")
    assert dirty_source(code) and not dirty_source(
        provenance_code(ROOT / "benchmarks/results/bench-20261205-010523.json")
    )


def copy_of(entry: dict, tmp: Path) -> Path:
    """A root holding copies of the entry's doc and run."""
    for rel in (entry["doc"], entry["run"]):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp / rel)
    return tmp


def other_number(number: str) -> str:
    """`number` with its last digit changed (1.09 -> 1.00, 96 -> 97)."""
    last = int(number[-1])
    return number[:-1] + str((last + 1) % 10 if last != 9 else 0)


@pytest.mark.parametrize(
    "figure",
    [
        "readme.headline.auto.tau",
        "readme.specbench-table.suffix.qa.ratio",
        "results.structured.20261205-010523.same-limit.tau",
    ],
)
def test_a_number_changed_in_a_copy_of_the_doc_fails(tmp_path: Path, figure: str):
    entry = next(f for f in FIGURE_LIST if f["id"] == figure)
    root = copy_of(entry, tmp_path)
    assert problems(entry, root) == []
    page = (root / entry["doc"]).read_text()
    changed_text = re.sub(
        rf"(?<![\d.,]){re.escape(entry['number'])}(?![\d]|[.,]\d)",
        other_number(entry["number"]),
        entry["text"],
        count=1,
    )
    assert changed_text != entry["text"] and page.count(entry["text"]) == 1
    (root / entry["doc"]).write_text(page.replace(entry["text"], changed_text))
    assert problems(entry, root), "a changed quote passed"
    # and the list brought in line with the changed doc still fails: the run holds the old number
    edited = {**entry, "text": changed_text, "number": other_number(entry["number"])}
    assert any("holds" in p for p in problems(edited, root))


def test_a_value_changed_in_a_copy_of_the_run_fails(tmp_path: Path):
    entry = next(f for f in FIGURE_LIST if f["id"] == "readme.structured.same-limit.tau")
    root = copy_of(entry, tmp_path)
    doc = json.loads((root / entry["run"]).read_text())
    holder = at(doc, entry["path"][:-1])
    holder[entry["path"][-1]] = 1.17  # was 1.140...: the README's 1.14× no longer its run's
    (root / entry["run"]).write_text(json.dumps(doc))
    found = problems(entry, root)
    assert any("now holds 1.17" in p for p in found) and any("quotes 1.14" in p for p in found)


def test_the_mismatch_the_audit_found_fails_and_its_fix_passes(tmp_path: Path):
    entry = next(f for f in FIGURE_LIST if f["id"] == "structured-outputs.guess.same-length.tau")
    assert entry["number"] == "1.350"
    stale = {**entry, "text": entry["text"].replace("1.350", "1.348"), "number": "1.348"}
    root = copy_of(entry, tmp_path)
    page = (root / entry["doc"]).read_text()
    (root / entry["doc"]).write_text(page.replace(entry["text"], stale["text"]))
    assert any("quotes 1.348" in p for p in problems(stale, root))
    assert problems(entry) == []


def test_the_rules():
    assert matches("1.350", 1.3502770285, "round:3") and not matches("1.348", 1.3502770285, "round:3")
    assert not matches("1.35", 1.3502770285, "round:3")  # the decimals must be the rule's
    assert matches("96", 0.961, "percent:0") and not matches("95", 0.961, "percent:0")
    assert matches("−5.1", -0.0507, "percent:1") and not matches("5.1", -0.0507, "percent:1")
    assert (
        matches("5,601", 5601.2, "round:0") and matches("1.83", 1.835, "round:2") and matches("1.84", 1.835, "round:2")
    )
    assert (
        has_number("**2.21×** sequential", "2.21")
        and not has_number("12.21", "2.21")
        and not has_number("2.215", "2.21")
    )
    assert at({"r": [{"m": "a", "v": 1}, {"m": "b", "v": 2}]}, ["r", {"m": "b"}, "v"]) == 2
    counted = next(f for f in FIGURE_LIST if f["id"] == "readme.failover.fp16.seeded.identical")
    assert (
        figure_value(counted, ROOT) == 4
        and figure_value({**counted, "count_where": {"case": "seeded auto"}}, ROOT) == 14
    )
    page = "## T\n\n| mode | all |\n|---|---|\n| `auto` | **2.65** (1.86×) |\n"
    assert table_cell(page, {"after": "## T", "row": "`auto`", "column": "all"}) == "**2.65** (1.86×)"


def test_the_structured_row_reads_the_frozen_sets_same_limit_first_and_calls_the_old_set_a_tuning_set():
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| structured outputs"))
    assert row.index("`prompts-json-headline.json`") < row.index("same 256-token limit") < row.index("same lengths")
    assert "`prompts-json-heldout.json`) — a tuning set" in row and "held-out" not in row
    first = next(f for f in FIGURE_LIST if f["id"] == "readme.structured.same-limit.tau")
    assert first["run"].endswith("bench-20261205-115156.json")
    assert row.index(first["text"]) < row.index("1.370×") < row.index("`prompts-json-heldout.json`")
