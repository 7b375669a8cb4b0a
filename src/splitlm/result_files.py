"""The one writer of result files: every bench, load test, audit and harden report goes through here.

    write_result(out, "bench", doc, stamp=time_stamp(doc["created"]), markdown=..., plots=..., latest="results.json")
        -> out/bench-20250102-030405.json, .md, -overview.png, ... and out/results.json (a copy)
    write_result(out, "audit", doc, markdown=..., markdown_name="report.md")
        -> out/audit.json, out/report.md (a fixed name in a directory of its own)

A stamped run started in the same second as another gets `-2`, `-3`, ... instead of overwriting it.
Whatever every result document should carry (provenance: commit, machine, command) is added here,
in `write_result`, once for all of them. A leaf module (the standard library only): the benches, the
audit and the CLI all write through it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


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


def write_result(out: str | Path, kind: str, doc: dict, *, stamp: str | None = None,
                 markdown: str | Callable[[list[Path]], str] | None = None, markdown_name: str | None = None,
                 plots: Callable[[Path], list[Path]] | None = None, latest: str | None = None) -> Written:
    """Write one run's result: `<base>.json`, then the plots (`plots(base)` writes them and returns
    their paths), then the Markdown report (a text, or made from the plots' paths) at `<base>.md`
    (or `out/<markdown_name>`), and a copy of the JSON as `out/<latest>`. `base` is `out/<kind>-<stamp>`
    (`out/<kind>` without a stamp)."""
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
