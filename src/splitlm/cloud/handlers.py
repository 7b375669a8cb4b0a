"""The single-process cloud's answers to OPEN, FORWARD, POLICY and CLOSE: the handlers of its request
table (`servicer.request_table`). A Ray replica's stage 0 uses them too (`cloud.ray_replica`), so
every answer is the one the single-process cloud gives."""

from __future__ import annotations

import asyncio
from typing import Protocol

import torch

from splitlm.cloud.metrics import CloudMetrics
from splitlm.cloud.scheduler import Done
from splitlm.cloud.servicer import Caller, CodecPool, RequestTable, request_table
from splitlm.cloud.sessions import ServerLimits, Session, SessionTable, validate
from splitlm.model.device import to_device
from splitlm.model.shards import CloudModel
from splitlm.transport.codecs import wire_nbytes
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import Frame, unpack_vocab
from splitlm.transport.messages import (
    RESULT_RESERVE_BYTES,
    Closed,
    Forward,
    Open,
    Opened,
    PolicyChange,
    PolicyOk,
    Result,
)

# the longest a step of an older session waits for younger ones mid-request to finish their pass and
# give way (`cloud.preemption`); then CAPACITY
ROOM_WAIT_S = 30.0


class StepRunner(Protocol):
    """What computes a checked request: a `Scheduler`, or a Ray replica's `Lanes`."""

    async def run(self, session: Session, req: Forward) -> Done: ...


class SessionRequests:
    """Requests on sessions whose caches this process holds, computed by its batching scheduler."""

    def __init__(
        self,
        model: CloudModel,
        device: torch.device,
        sessions: SessionTable,
        scheduler: StepRunner,
        limits: ServerLimits,
        metrics: CloudMetrics,
        codec: CodecPool,
    ):
        self.model, self.device, self.sessions, self.scheduler = model, device, sessions, scheduler
        self.limits, self.metrics, self.codec = limits, metrics, codec
        self.request_ended: asyncio.Event | None = None  # set whenever a FORWARD ends (made on the event loop)

    def table(self) -> RequestTable:
        return request_table(self.open, self.forward, self.policy, self.close)

    async def open(self, conn: Caller, frame: Frame) -> Frame:
        """A new session with an empty cache (split-head: with its authorised vocabulary)."""
        req = Open.from_frame(frame)
        vocab = self.parse_vocab(req.vocab)
        s = self.sessions.open(
            conn.client_key, req.wire_dtype, len(self.model.middle.layers), conn.id, req.cache_policy
        )
        s.vocab = None if vocab is None else to_device(vocab, self.device)
        vocab_size = None
        if self.model.split_head:
            vocab_size = self.model.cfg.vocab_size if vocab is None else vocab.numel()
        return Opened(s.id, req.wire_dtype, req.cache_policy, self.model.manifest.topology, vocab_size).to_frame()

    async def close(self, conn: Caller, frame: Frame) -> Frame:
        self.sessions.close(frame.session, conn.client_key, conn.id)
        return Closed(frame.session).to_frame()

    async def policy(self, conn: Caller, frame: Frame) -> Frame:
        """Tighten a session's cache policy and/or revoke (wipe) its cache now."""
        session = self.sessions.get(frame.session, conn.client_key, conn.id)
        req = PolicyChange.from_frame(frame)
        if req.cache_policy is not None:
            session.tighten(req.cache_policy, req.key)
        if req.revoke:
            session.wipe()
        return PolicyOk(session.id, session.policy, session.cache_shape[0]).to_frame()

    async def forward(self, conn: Caller, frame: Frame) -> Frame:
        """Check the request, reserve its KV memory, queue it for a pass; its RESULT. The session is
        mid-request (never preempted) from here until its reply is built."""
        session = self.sessions.get(frame.session, conn.client_key, conn.id)
        try:
            with self.sessions.active(session):
                return await self.compute(session, frame)
        finally:
            self.ended().set()  # a waiting older step may now free this session

    def ended(self) -> asyncio.Event:
        if self.request_ended is None:
            self.request_ended = asyncio.Event()
        return self.request_ended

    async def reserve(self, session: Session, entries: int) -> None:
        """Reserve the step's KV memory (`SessionTable.reserve`); while younger sessions mid-request hold
        the room, wait for their FORWARDs to end (at most `ROOM_WAIT_S`, then CAPACITY)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ROOM_WAIT_S
        ended = self.ended()
        while not self.sessions.reserve(session, entries, wait=loop.time() < deadline):
            ended.clear()
            try:
                await asyncio.wait_for(ended.wait(), max(0.001, deadline - loop.time()))
            except (TimeoutError, asyncio.TimeoutError):
                pass

    async def compute(self, session: Session, frame: Frame) -> Frame:
        req, entries = await self.codec.run(len(frame.payload), self.parse_forward, session, frame)
        t = req.new_tokens
        if self.model.split_head:
            self.check_reply_size(session, t if req.rows is None else len(req.rows), req.control.dtype)
        await self.reserve(session, entries)  # preempts, waits for younger passes, or CAPACITY / EXCEEDS_BUDGET
        try:
            done = await self.scheduler.run(session, req)
        finally:
            self.sessions.settle(session)
        self.metrics.count_forward(t, req.context, done.compute_s, done.queue_s)
        out = done.outputs
        result = Result(
            session.id, out.hidden, session.cache_shape[0], out.logits, compute_s=done.compute_s, queue_s=done.queue_s
        )
        try:
            return await self.codec.run(result.nbytes, result.to_frame, req.control.dtype or session.wire_dtype)
        except OverflowError as e:  # the session's cache is intact; the edge may reopen with bf16
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None

    def parse_vocab(self, value: bytes | None) -> torch.Tensor | None:
        """OPEN's `vocab` (packed bits of the authorised ids): split-head clouds only; None = every id."""
        if value is None:
            return None
        if not self.model.split_head:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "vocab only applies to a split-head cloud (this one holds no part of the LM head)",
            )
        return unpack_vocab(value, self.model.cfg.vocab_size)  # [S] ascending ids

    def parse_forward(self, session: Session, frame: Frame) -> tuple[Forward, int]:
        """The request, checked (`validate`); with the entries its cache holds during the pass."""
        max_elems = self.limits.max_tokens_per_forward * self.model.cfg.hidden_size  # context rows included
        req = Forward.from_frame(frame, max_elems)
        return req, validate(req, session, self.model, self.limits)

    def check_reply_size(self, session: Session, rows: int, dtype: str | None) -> None:
        """A split-head RESULT holds `rows` × (d + S) values: refuse one over max_frame_bytes before computing."""
        s = self.model.cfg.vocab_size if session.vocab is None else session.vocab.numel()
        dtype = dtype or session.wire_dtype
        size = wire_nbytes(dtype, [rows, s]) + wire_nbytes(dtype, [rows, self.model.manifest.d_end])
        if size + RESULT_RESERVE_BYTES > self.limits.max_frame_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"logits for {rows} rows ({size} bytes) exceed the frame limit of "
                f"{self.limits.max_frame_bytes} bytes; ask for fewer rows",
            )
