"""Progress bars for long jobs: tqdm on stderr, shown only on a terminal and never under `--quiet`.

    with bar(total=len(prompts), desc="warmup", unit="prompt") as b:
        for batch in batches:
            ...
            b.update(len(batch))

    for doc in track(documents, desc="audit"):
        ...

Quiet is process-wide and inherited by child processes (a bench's cloud server): `set_quiet(True)`
sets $SPLITLM_QUIET. Status lines go through `logging` (configured once, in the CLI), not here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

QUIET_ENV = "SPLITLM_QUIET"
T = TypeVar("T")


def set_quiet(quiet: bool) -> None:
    if quiet:
        os.environ[QUIET_ENV] = "1"
    else:
        os.environ.pop(QUIET_ENV, None)


def is_quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def shown() -> bool:
    """Whether bars are drawn: stderr is a terminal and quiet is off."""
    return not is_quiet() and sys.stderr.isatty()


def bar(
    total: float | None = None, desc: str = "", unit: str = "it", *, unit_bytes: bool = False, leave: bool = False
) -> tqdm:
    """A tqdm bar (a no-op object when not shown); use as a context manager, `.update(n)`."""
    scale = dict(unit="B", unit_scale=True, unit_divisor=1024) if unit_bytes else dict(unit=unit)
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not shown(), leave=leave, dynamic_ncols=True, **scale)


def track(items: Iterable[T], desc: str = "", total: int | None = None, unit: str = "it") -> Iterator[T]:
    """`items`, with a bar that advances once per item."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with bar(total, desc, unit) as b:
        for item in items:
            yield item
            b.update(1)
