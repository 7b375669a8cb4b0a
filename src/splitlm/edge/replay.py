"""Failover of an `EdgeSession`: a new cloud session (on the same or another cloud) rebuilt from
what the edge holds, and the requests still owed a reply replayed into it (docs/failover.md).

`EdgeSession.failover`, `_replay` and `_rebuild` are thin methods over `failover`, `replay` and
`rebuild` here (`session`: the `EdgeSession` that lost its cloud; not imported here, since
session.py imports this module)."""

from __future__ import annotations

import logging
import time

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from splitlm.model.device import to_host
from splitlm.transport.client import CloudError
from splitlm.transport.messages import Forward

log = logging.getLogger(__name__)


def failover(session, error: CloudError) -> None:
    """The connection or the cloud died (`error`): reconnect (`Edge.reconnect`: the next cloud of
    the list, backoff, at most `Edge.failover_timeout_s`), open a new session and replay into it
    every request whose reply is still owed, so that decoding goes on as if nothing happened.

    What the new session's cache needs is what the edge keeps anyway: the head layers' outputs of
    every committed token (`history`) and of every block in flight (`Flight.h`); nothing is
    recomputed. The first owed block goes up with the whole committed context as context rows
    (a window policy: its last N), each later one with the keep of the block before it; a
    context longer than the cloud's tokens per forward is rebuilt in chunks first. Rolled-back
    (void) blocks are not re-sent: their replies are dropped unread. A sealed session gets a new
    cache key (the new session's seal counter starts again)."""
    edge = session.edge
    t0 = time.perf_counter()
    deadline = time.monotonic() + edge.failover_timeout_s
    log.warning("cloud session %d lost (%s): failing over", session.id, error)
    while True:
        dead = session.client
        edge._drop_client(dead)
        authorised = edge.vocab.packed() if edge.split_head and not edge.vocab.everything else None
        session.client, session.id = edge.reconnect(session.policy, authorised, dead.url, deadline)
        if session.key is not None:
            session.key = AESGCM.generate_key(bit_length=256)
        try:
            session._replay()
            break
        except CloudError as e:
            if not e.retryable or time.monotonic() > deadline:
                raise
            log.warning("the new cloud session failed too (%s): failing over again", e)
    session.stats.failovers += 1
    session.stats.failover_s += time.perf_counter() - t0
    log.warning("failed over to %s (session %d) in %.2f s", session.client.url, session.id, time.perf_counter() - t0)


def replay(session) -> None:
    """Rebuild an empty cloud session's cache and re-send the blocks still owed a reply (see `failover`)."""
    session.cloud_committed = session.cloud_pending = 0
    session.cloud_keep = session.cloud_crop = None
    policy = session.policy
    retained = policy.retention > 0
    owed = []
    for f in session.flights:
        if f.void:
            f.sent = None  # its reply is dropped unread
        else:
            owed.append(f)
    if owed:
        owed[0].replayed = True
    prev = None
    for f in owed:
        if prev is None:
            c = f.start if policy.window is None else min(f.start, policy.window)
            if retained and policy.window is None:
                c -= session._rebuild(f.start, len(f.ids))
        else:
            replay_keep(session, prev)
            c = f.start - session.cloud_committed if retained else f.start
        session._transmit(f, c)
        prev = f
    if prev is not None and prev.settled:
        replay_keep(session, prev)


def replay_keep(session, f) -> None:
    """The cloud-side bookkeeping of settling block `f` (a `Flight`, sent to the new session) with its keep."""
    if session.policy.retention == 0:
        return
    if f.keep is not None:
        session.cloud_keep = list(f.keep)
    session.cloud_committed += len(f.ids) if f.keep is None else len(f.keep)
    session.cloud_pending = 0


def rebuild(session, upto: int, then: int) -> int:
    """Send committed rows [0, upto) to the cloud as blocks of their own until the rest fits in one
    forward with `then` new tokens (the cloud's tokens per forward); returns the rows sent so."""
    edge = session.edge
    per_forward = session.client.info.limits.max_tokens_per_forward
    done = 0
    while per_forward and upto - done + then > per_forward:
        n = min(per_forward, upto - done)
        h, pos = to_host(session.history[done:done + n]), session.history_pos[done:done + n]  # [n, D]
        request = Forward(h, torch.as_tensor(pos, dtype=torch.long), control=session.control(),
                          rows=[n - 1] if edge.split_head else None)
        client = session.client
        client.receive_forward(client.send_forward(session.id, request, session.wire_dtype,
                                                   max(h.numel(), edge.vocab.size)))
        done += n
        session.cloud_committed = done
    return done
