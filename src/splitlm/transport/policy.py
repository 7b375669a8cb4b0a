"""Cache policies: what the cloud may keep of a session's history between requests.

    session    the KV cache lives until the session ends (default)
    window:N   at most N entries survive a request; older ones are wiped
    sealed     between requests the cache exists only encrypted, under a key the edge sends with
               each request (the cloud forgets the key after the request)
    none       nothing survives a request; the edge re-sends the history as context rows

A policy may be tightened during a session, never loosened: retention may only shrink, and a
sealed cache may not become readable at rest again (unless it is dropped: `none`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("session", "window", "sealed", "none")
MAX_WINDOW = 2**63 - 1  # window:N's largest N: the wire's (msgpack's) signed 64-bit integers


@dataclass(frozen=True)
class CachePolicy:
    mode: str = "session"
    window: int | None = None  # entries kept, for mode "window"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown cache policy {self.mode!r} (choose from none, session, window:N, sealed)")
        if (self.mode == "window") != (self.window is not None):
            raise ValueError("window:N needs N, and only window takes one")
        if self.window is not None and (type(self.window) is not int or not 1 <= self.window <= MAX_WINDOW):
            raise ValueError(f"window:N needs an integer N >= 1 (at most 2**63 - 1), got {self.window!r}")

    @classmethod
    def parse(cls, text: str | CachePolicy) -> CachePolicy:
        if isinstance(text, CachePolicy):
            return text
        if not isinstance(text, str):
            raise ValueError(f"a cache policy is a string, got {type(text).__name__}")
        mode, _, arg = text.partition(":")
        if mode == "window":
            if not arg.isdigit():
                raise ValueError(f"window:N needs an integer N >= 1, got {text!r}")
            return cls("window", int(arg))
        if arg:
            raise ValueError(f"cache policy {mode!r} takes no argument")
        return cls(mode)

    def __str__(self) -> str:
        return f"window:{self.window}" if self.mode == "window" else self.mode

    @property
    def retention(self) -> float:
        """How many entries may survive a request."""
        return {"session": math.inf, "sealed": math.inf, "none": 0}.get(self.mode, self.window)

    @property
    def sealed(self) -> bool:
        return self.mode == "sealed"

    def allows(self, new: CachePolicy) -> bool:
        """Whether `new` is at least as tight as this policy (never a loosening)."""
        if new.retention > self.retention:
            return False
        return new.sealed or new.retention == 0 or not self.sealed
