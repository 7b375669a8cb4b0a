"""Preemption: which sessions the cloud frees when its KV budget is full, and what it remembers of them.

A session is freed (its cache dropped) rather than a new session or a growing step refused, with one
rule that guarantees progress: **a younger session never takes memory from an older one that is
running**. Running: mid-request (a FORWARD of it queued, computing or being answered: `Session.active`),
used in the last `RUNNING_S` (between the steps of a generation: its edge is drafting or its reply
is on the wire), or just opened and not yet used (`OPEN_GRACE_S`). An OPEN is the youngest of all, so
it may free only sessions that sit idle; a step of an older session may free any younger one, least
recently active first, and waits for the pass of a younger one that is mid-request rather than be
refused (`Room.wait`). So the oldest running request always gets the memory it needs (if the whole
budget holds it: else `EXCEEDS_BUDGET`), finishes, and the next oldest goes on: every request
finishes at any budget that fits one, and the cloud cannot livelock. A younger session that finds
no room is told `CAPACITY` (its edge retries with backoff).

A freed session's id becomes a *tombstone*: the next request on it is answered `PREEMPTED`
(docs/protocol.md §7), and the edge opens a new session and replays its context into it, as after a
failover (docs/failover.md). Sessions idle for `ServerLimits.idle_timeout_s` are freed the same way
(`SessionTable.expire`).

Tombstones are bounded (`MAX_TOMBSTONES`, oldest forgotten first: a request on a forgotten one gets
`UNKNOWN_SESSION`) and end with their connection, like sessions.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

MAX_TOMBSTONES = 4096
# a session just opened is spared this long before its first FORWARD: under churn, a replaying edge's
# new session would otherwise be freed before its replay arrives, and the edges would thrash
OPEN_GRACE_S = 2.0
# a session used this recently is running a generation (between two of its steps): a younger one may
# not free it (at 80 ms RTT a step's gap is ~0.1-0.3 s; an edge of a large model may take ~1 s)
RUNNING_S = 2.0


class Preemptible(Protocol):
    """What the choice reads of a session (`cloud.sessions.Session`)."""

    active: int  # requests being handled
    grace_until: float  # time.monotonic() before which a just-opened, unused session is spared
    last_used: float  # time.monotonic() of its last request's arrival or reply
    opened: float  # time.monotonic() of its OPEN: its age, which decides who may free whom
    kv_reserved: int  # bytes of the budget it holds


S = TypeVar("S", bound=Preemptible)


def running(s: Preemptible, now: float) -> bool:
    """Mid-request, used in the last `RUNNING_S`, or opened and not yet used."""
    return bool(s.active) or now - s.last_used < RUNNING_S or s.grace_until > now


@dataclass
class Room(Generic[S]):
    """How `need` bytes could be freed for a requester.

    victims: the sessions to free now (None: not enough can be freed now). wait: enough could be
    freed once younger sessions that are mid-request finish their pass (only an older requester's
    step waits; an OPEN never does). held: bytes of the other sessions by why they may not be freed."""

    victims: list[S] | None
    wait: bool = False
    held: dict[str, int] = field(default_factory=dict)


def room(sessions: Iterable[S], need: int, requester: Preemptible | None = None) -> Room[S]:
    """Which sessions to free for `need` bytes: those that sit idle, least recently active first, then
    (for a `requester` step) the running sessions younger than it, least recently active first.
    `requester` None: an OPEN (younger than every session). Never the requester itself."""
    now = time.monotonic()
    born = requester.opened if requester is not None else float("inf")
    free_now, later, held = [], [], Counter()
    for s in sessions:
        if s is requester:
            continue
        if not running(s, now):
            free_now.append(s)
        elif s.opened >= born:  # younger than the requester (an OPEN has no younger sessions)
            (later if s.active else free_now).append(s)
            if s.active:
                held["mid-request (younger)"] += s.kv_reserved
        else:
            held["mid-request" if s.active else "running"] += s.kv_reserved
    free_now.sort(key=lambda s: (running(s, now), s.last_used))
    chosen, freed = [], 0
    for s in free_now:
        if freed >= need:
            break
        chosen.append(s)
        freed += s.kv_reserved
    if freed >= need:
        return Room(chosen, held=dict(held))
    waiting = freed + sum(s.kv_reserved for s in later) >= need
    return Room(None, wait=waiting, held=dict(held))


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
