"""The one writer of result files: every bench, load test, audit and harden report goes through here.

    write_result(out, "bench", doc, stamp=time_stamp(doc["created"]), markdown=..., plots=..., latest="results.json")
        -> out/bench-20250102-030405.json, .md, -overview.png, ... and out/results.json (a copy)
    write_result(out, "audit", doc, markdown=..., markdown_name="report.md")
        -> out/audit.json, out/report.md (a fixed name in a directory of its own)

A stamped run started in the same second as another gets `-2`, `-3`, ... instead of overwriting it.
Whatever every result document should carry is added here, in `write_result`, once for all of them:
its `provenance` (`provenance()`): the commit and whether the tree was dirty, the draft heads the run
loaded (path, SHA-256, training report), the CPU and its cores, torch's threads, the load average
when the run started and when it was written, and the exact command. The start is what `begin_run()`
saw: `splitlm`'s `main` calls it first, scripts call it at their start. A leaf module (the standard
library only): the benches, the audit and the CLI all write through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROVENANCE_SCHEMA = "splitlm.provenance/1"
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when running from one (src/splitlm/..)


def default_results_dir() -> Path:
    """Where bench, loadtest and train-head write by default, outside any source tree: $SPLITLM_RESULTS,
    else $XDG_DATA_HOME/splitlm/results, else ~/.local/share/splitlm/results."""
    if env := os.environ.get("SPLITLM_RESULTS"):
        return Path(env)
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "splitlm" / "results"


@dataclass
class RunStart:
    """The run as it started: when, the machine's load average then, the command, and the code (its
    commit and dirty files then: a tree edited while a long run goes on does not change what it ran)."""

    time: float
    load_avg: list[float]
    argv: list[str]
    code: dict = field(default_factory=dict)


_run: dict = {"start": None, "heads": {}}  # this process's run: its RunStart and the draft heads it loaded


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def begin_run(argv: list[str] | None = None) -> RunStart:
    """Note the start of a run (its time, the load average now, the command: `argv`, else sys.argv);
    `provenance()` reports it. Forgets the heads noted by an earlier run in this process."""
    _run["start"] = RunStart(time.time(), load_average() or [], list(sys.argv if argv is None else argv), code_state())
    _run["heads"] = {}
    return _run["start"]


def note_head(path: str | Path) -> None:
    """Record that this run drafts with the head at `path` (the head loader calls it)."""
    _run["heads"][str(Path(path).resolve())] = Path(path).resolve()


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a file, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def head_entry(path: Path) -> dict:
    """A draft head as a result records it: its path, SHA-256 and training report (next to it, if any)."""
    report = path.with_suffix(".json")
    return {
        "path": str(path),
        "sha256": file_digest(path) if path.is_file() else None,
        "report": str(report) if report.is_file() else None,
    }


def git(*args: str) -> str | None:
    """`git ARGS` in the source checkout; None outside one or when git fails."""
    if not (SOURCE_ROOT / ".git").exists():
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "-C", str(SOURCE_ROOT), *args], capture_output=True, text=True, timeout=20)
        if done.returncode == 0:
            return done.stdout
    return None


def code_state() -> dict:
    """The commit the code ran from and whether the tree was dirty: a tracked file changed, or an untracked
    file under src/ (up to 20 of the changed paths listed). Outside a checkout: the package version only."""
    from splitlm import __version__

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "dirty_files": [], "version": __version__}
    lines = (git("status", "--porcelain", "--untracked-files=all") or "").splitlines()
    changed = [ln[3:] for ln in lines if not ln.startswith("??") or ln[3:].startswith("src/")]
    return {"commit": commit.strip(), "dirty": bool(changed), "dirty_files": changed[:20], "version": __version__}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def torch_threads() -> int | None:
    """torch's intra-op threads, if this process has imported torch (never imported here)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None and hasattr(torch, "get_num_threads") else None


def provenance(heads: list[str | Path] | None = None) -> dict:
    """What produced a result: code (commit, dirty; as the run started), draft heads (`heads` and those noted by the
    loader), machine, torch threads, load average at the start (`begin_run`; None if no start was noted) and now,
    and the command."""
    start: RunStart | None = _run["start"]
    argv = start.argv if start else list(sys.argv)
    paths = {**{str(Path(h).resolve()): Path(h).resolve() for h in heads or []}, **_run["heads"]}  # `heads` first
    return {
        "schema": PROVENANCE_SCHEMA,
        "code": start.code if start and start.code else code_state(),
        "draft_heads": [head_entry(p) for p in paths.values()],
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "torch_threads": torch_threads(),
        "load_avg": {"start": start.load_avg if start else None, "end": load_average()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(start.time)) if start else None,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": argv,
        "command_line": shlex.join(argv),
    }


@dataclass
class Written:
    """The files one `write_result` call wrote."""

    json: Path
    markdown: Path | None = None
    plots: list[Path] = field(default_factory=list)
    latest: Path | None = None  # the copy of the JSON under a fixed name (bench's results.json)

    @property
    def paths(self) -> list[Path]:
        """The run's own files: the JSON, the Markdown report, the plots (not the `latest` copy)."""
        return [self.json, *([self.markdown] if self.markdown else []), *self.plots]


def time_stamp(created: str) -> str:
    """The stamp of a file name from an ISO time: '2025-01-02T03:04:05+0000' -> '20250102-030405'."""
    return created[:19].replace("-", "").replace(":", "").replace("T", "-")


def suffixed(base: Path, suffix: str) -> Path:
    """`base` with `suffix` appended (not `with_suffix`: a prefix may hold a dot, e.g. a model name)."""
    return base.with_name(base.name + suffix)


def result_base(out: str | Path, kind: str, stamp: str | None = None) -> Path:
    """`out/<kind>-<stamp>` (no suffix; `out/<kind>` without a stamp); makes `out`.

    When a run already wrote `<base>.json` (two runs started in the same second) a stamped base
    becomes `<base>-2`, `<base>-3`, ... so neither overwrites the other; an unstamped one is
    rewritten in place (a report re-rendered in its own directory)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if stamp is None:
        return out / kind
    base, n = out / f"{kind}-{stamp}", 2
    while suffixed(base, ".json").exists():
        base, n = out / f"{kind}-{stamp}-{n}", n + 1
    return base


def write_json(path: str | Path, doc: dict) -> Path:
    """`doc` as indented JSON at `path` (its directory made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def write_result(
    out: str | Path,
    kind: str,
    doc: dict,
    *,
    stamp: str | None = None,
    markdown: str | Callable[[list[Path]], str] | None = None,
    markdown_name: str | None = None,
    plots: Callable[[Path], list[Path]] | None = None,
    latest: str | None = None,
) -> Written:
    """Write one run's result: `<base>.json`, then the plots (`plots(base)` writes them and returns
    their paths), then the Markdown report (a text, or made from the plots' paths) at `<base>.md`
    (or `out/<markdown_name>`), and a copy of the JSON as `out/<latest>`. `base` is `out/<kind>-<stamp>`
    (`out/<kind>` without a stamp). `doc` gets its `provenance` first (unless it has one: a run that used
    draft heads the loader did not note gives it `provenance(heads)`), so that the Markdown report can show it."""
    doc.setdefault("provenance", provenance())
    base = result_base(out, kind, stamp)
    written = Written(write_json(suffixed(base, ".json"), doc))
    if plots is not None:
        written.plots = plots(base)
    if markdown is not None:
        text = markdown(written.plots) if callable(markdown) else markdown
        written.markdown = base.parent / markdown_name if markdown_name else suffixed(base, ".md")
        written.markdown.write_text(text)
    if latest is not None:
        written.latest = base.parent / latest
        shutil.copyfile(written.json, written.latest)
    return written
