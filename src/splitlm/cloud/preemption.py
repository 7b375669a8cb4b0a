"""Preemption: which sessions the cloud frees when its KV budget is full, and what it remembers of them.

A session is freed (its cache dropped) rather than a new session or a growing step refused: the least
recently active sessions first, never one that is mid-request (a FORWARD of it queued, computing or
being answered: `Session.active`). Its id becomes a *tombstone*: the next request on it is answered
`PREEMPTED` (docs/protocol.md §7), and the edge opens a new session and replays its context into it,
as after a failover (docs/failover.md). Sessions idle for `ServerLimits.idle_timeout_s` are freed the
same way (`SessionTable.expire`).

Tombstones are bounded (`MAX_TOMBSTONES`, oldest forgotten first: a request on a forgotten one gets
`UNKNOWN_SESSION`) and end with their connection, like sessions.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

MAX_TOMBSTONES = 4096
# a session just opened is not preempted before its first FORWARD for this long: under churn, a replaying
# edge's new session would otherwise be freed before its replay arrives, and the edges would thrash
OPEN_GRACE_S = 2.0


class Preemptible(Protocol):
    """What the choice reads of a session (`cloud.sessions.Session`)."""

    active: int  # requests being handled
    grace_until: float  # time.monotonic() before which a just-opened, unused session is spared
    last_used: float  # time.monotonic() of its last request's arrival or reply
    kv_reserved: int  # bytes of the budget it holds


S = TypeVar("S", bound=Preemptible)


def victims(sessions: Iterable[S], need: int) -> list[S] | None:
    """The least recently active idle sessions whose reservations add up to at least `need` bytes
    (None: even all of them would not free enough, so none is freed). Sessions mid-request, and those
    opened less than `OPEN_GRACE_S` ago that have not sent their first FORWARD yet, are never chosen."""
    now = time.monotonic()
    idle = (s for s in sessions if not s.active and s.grace_until <= now)
    chosen, freed = [], 0
    for s in sorted(idle, key=lambda s: s.last_used):
        if freed >= need:
            break
        chosen.append(s)
        freed += s.kv_reserved
    return chosen if freed >= need else None


@dataclass
class Tombstone:
    owner: bytes  # the client key that opened the session (only it is told PREEMPTED; others: UNKNOWN_SESSION)
    conn: int | str  # the connection it was bound to
    told: bool = False  # a request on it was answered PREEMPTED


class Tombstones:
    """The ids of freed sessions, so that their edges are told `PREEMPTED` rather than `UNKNOWN_SESSION`;
    and, per client key, how many were told and not yet followed by an OPEN of that key (on any
    connection: an edge whose cloud was full goes round its clouds on new connections), i.e. replays."""

    def __init__(self, limit: int = MAX_TOMBSTONES):
        self.limit = limit
        self.stones: OrderedDict[int, Tombstone] = OrderedDict()
        self.told: Counter[bytes] = Counter()

    def __len__(self) -> int:
        return len(self.stones)

    def add(self, sid: int, owner: bytes, conn: int | str) -> None:
        self.stones[sid] = Tombstone(owner, conn)
        while len(self.stones) > self.limit:
            self.stones.popitem(last=False)

    def find(self, sid: int, owner: bytes, conn: int | str | None) -> Tombstone | None:
        """The tombstone of `sid`, if `owner` (and, when given, connection `conn`) held the session."""
        stone = self.stones.get(sid)
        if stone is None or stone.owner != owner or (conn is not None and stone.conn != conn):
            return None
        return stone

    def tell(self, stone: Tombstone) -> None:
        """A request on `stone` is answered PREEMPTED (the first time, its client owes a re-open)."""
        if not stone.told:
            stone.told = True
            if stone.owner not in self.told and len(self.told) >= self.limit:
                self.told.pop(next(iter(self.told)))  # bounded: the oldest client's count goes
            self.told[stone.owner] += 1

    def reopened(self, owner: bytes) -> bool:
        """An OPEN by client key `owner`: whether it follows a PREEMPTED answer to it (a replay)."""
        if not self.told[owner]:
            return False
        self.told[owner] -= 1
        if not self.told[owner]:
            del self.told[owner]
        return True

    def forget(self, sid: int) -> None:
        self.stones.pop(sid, None)

    def drop_connection(self, conn: int | str) -> None:
        for sid in [sid for sid, stone in self.stones.items() if stone.conn == conn]:
            del self.stones[sid]
