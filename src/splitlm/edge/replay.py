"""Failover of an edge session: a new cloud session (on the same or another cloud) rebuilt from
what the edge holds, and the requests still owed a reply replayed into it (docs/failover.md); also
after the cloud preempted the session (a replay onto the same cloud).

`EdgeSession.failover` is the entry point: the session calls `failover` here whenever its cloud side
(`splitlm.edge.link.CloudLink`) raises a recoverable `CloudError`, then goes on with what it was
doing; `failover`, `replay` and `rebuild` work through the link's public methods."""

from __future__ import annotations

import logging
import time

import torch

from splitlm.edge.link import CloudLink, Flight
from splitlm.model.device import to_host
from splitlm.transport.client import CloudError
from splitlm.transport.errors import ErrorCode
from splitlm.transport.messages import Forward

log = logging.getLogger(__name__)


def failover(link: CloudLink, error: CloudError) -> None:
    """The connection or the cloud died (`error`): reconnect (`CloudConnections.reconnect`: the next
    cloud of the list, backoff, at most `CloudConnections.failover_timeout_s`), open a new session and
    replay into it every request whose reply is still owed, so that decoding goes on as if nothing happened.
    The cloud freed the session (`PREEMPTED`): the same, on the same connection first (`CloudLink.resume`).

    What the new session's cache needs is what the edge keeps anyway: the head layers' outputs of
    every committed token (`history`) and of every block in flight (`Flight.h`); nothing is
    recomputed. The first owed block goes up with the whole committed context as context rows
    (a window policy: its last N), each later one with the keep of the block before it; a
    context longer than the cloud's tokens per forward is rebuilt in chunks first. Rolled-back
    (void) blocks are not re-sent: their replies are dropped unread. A sealed session gets a new
    cache key (the new session's seal counter starts again)."""
    t0, started = time.perf_counter(), time.monotonic()
    deadline = started + link.connections.failover_timeout_s
    preempted = error.code == ErrorCode.PREEMPTED
    log_fault(link, error, preempted)
    while True:
        if preempted:
            link.resume(deadline)
        else:
            link.reopen(deadline)
        try:
            replay(link)
            break
        except CloudError as e:
            if not e.recoverable or time.monotonic() > link.connections.give_up_at(e, deadline, started):
                raise
            preempted = e.code == ErrorCode.PREEMPTED
            log.warning("the new cloud session failed too (%s): failing over again", e)
    took = time.perf_counter() - t0
    if error.code == ErrorCode.PREEMPTED:
        link.stats.preemptions += 1
        log.info("replayed into session %d on %s after a preemption in %.2f s", link.id, link.client.url, took)
        return
    link.stats.failovers += 1
    link.stats.failover_s += took
    log.warning("failed over to %s (session %d) in %.2f s", link.client.url, link.id, took)


def log_fault(link: CloudLink, error: CloudError, preempted: bool) -> None:
    """A preemption, or a full cloud (CAPACITY), is the cloud's routine (INFO); a lost cloud is worth a WARNING."""
    if preempted:
        log.info("cloud session %d preempted (%s): reopening and replaying", link.id, error)
    elif error.code == ErrorCode.CAPACITY:
        log.info("cloud session %d refused for now (%s): reopening when there is room", link.id, error)
    else:
        log.warning("cloud session %d lost (%s): failing over", link.id, error)


def replay(link: CloudLink) -> None:
    """Rebuild an empty cloud session's cache and re-send the blocks still owed a reply (see `failover`)."""
    link.cloud.forget()
    policy = link.policy
    retained = policy.retention > 0
    owed = link.owed()  # void blocks are not: their replies are dropped unread
    prev = None
    for f in owed:
        if prev is None:
            c = f.start if policy.window is None else min(f.start, policy.window)
            if retained and policy.window is None:
                c -= rebuild(link, f.start, len(f.ids))
        else:
            replay_keep(link, prev)
            c = f.start - link.cloud.committed if retained else f.start
        link.transmit(f, c)
        prev = f
    if prev is not None and prev.settled:
        replay_keep(link, prev)


def replay_keep(link: CloudLink, f: Flight) -> None:
    """The cloud-side bookkeeping of settling block `f` (sent to the new session, so the cloud's
    pending block) with its keep."""
    link.cloud.settle(f.keep, len(f.ids) if f.keep is None else len(f.keep))


def rebuild(link: CloudLink, upto: int, then: int) -> int:
    """Send committed rows [0, upto) to the cloud as blocks of their own until the rest fits in one
    forward with `then` new tokens (the cloud's tokens per forward); returns the rows sent so."""
    per_forward = link.client.info.limits.max_tokens_per_forward
    done = 0
    while per_forward and upto - done + then > per_forward:
        n = min(per_forward, upto - done)
        h, pos = to_host(link.history[done : done + n]), link.history_pos[done : done + n]  # [n, D]
        request = Forward(
            h, torch.as_tensor(pos, dtype=torch.long), control=link.control(), rows=link.backend.reply_rows([n - 1])
        )
        client = link.client
        client.receive_forward(
            client.send_forward(link.id, request, link.wire_dtype, max(h.numel(), link.backend.vocab.size))
        )
        done += n
        link.cloud.rebuilt(done)
    return done
