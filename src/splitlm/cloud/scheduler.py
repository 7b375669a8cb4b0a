"""The batching scheduler: one compute thread runs the ready steps of all sessions in shared passes.

Requests arrive from the event loop (`submit`, thread-safe) and queue in arrival order. Each pass
takes, in that order, as much as fits (`BatchConfig`): at most `max_batch` sessions and
`max_batch_tokens` rows, at most one request per session (a session's requests stay in order),
and at most `prefill_chunk` rows of any one causal request. A longer causal request (a prefill,
context rows) therefore runs in chunks over several passes, keeping its place in the queue, and
the steps of other sessions that arrive meanwhile join the passes: after a pass with a chunk, the
next pass runs only the other waiting steps (when there are any), so a step that arrives during a
chunk's pass waits for that pass but not also for the next chunk, and a 2,048-token prefill delays
the other sessions' steps by about one chunk's compute, not by the whole prefill. A request with a
mask (a token tree, a lookahead window) runs whole; one larger than `max_batch_tokens` runs alone.
`take` decides a pass (a `PassPlan` of `Piece`s); the runner executes it on the middle layers
(`cloud.runner`: rows packed for the dense layers, attention per session on its own cache); the
scheduler answers the requests it finished or failed. Requests of a session that was closed
meanwhile (CLOSE, its connection ended, expiry) are dropped without being computed.

While a pass runs, new requests queue and join the next one, so batches form by themselves under
load and a lone edge never waits for company (no gathering delay). `max_batch = 1` is the old
one-request-at-a-time cloud (and the baseline of `splitlm loadtest`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from splitlm.cloud.runner import Job, Outputs, PassPlan, PassReport, PassRunner, Piece
from splitlm.cloud.sessions import Session
from splitlm.model.shards import CloudModel
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.messages import Forward


@dataclass
class BatchConfig:
    max_batch: int = 16  # sessions per pass (1 = no batching)
    max_batch_tokens: int = 2048  # rows per pass (context rows included); an unchunkable larger request runs alone
    prefill_chunk: int = 256  # rows of one causal request per pass (longer ones are chunked)

    def __post_init__(self):
        if min(self.max_batch, self.max_batch_tokens, self.prefill_chunk) < 1:
            raise ValueError("max_batch, max_batch_tokens and prefill_chunk must be >= 1")


@dataclass
class Done:
    """A request's outcome: its reply tensors, how long it waited for its first pass, how long it took."""

    outputs: Outputs
    queue_s: float
    compute_s: float  # from submit to output (queue_s included)
    passes: int  # passes it took (more than one: chunked)


class Scheduler:
    def __init__(self, model: CloudModel, config: BatchConfig | None = None, on_pass=None):
        """`on_pass(PassTiming)`: called on the compute thread after each pass (metrics)."""
        self.model, self.config = model, config or BatchConfig()
        self.runner = PassRunner(model)
        self.on_pass = on_pass
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._ran_long = False  # the last pass ran a chunk of a long request
        self.passes = 0
        self._thread = threading.Thread(target=self._loop, daemon=True, name="splitlm-compute")
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def queued_rows(self) -> int:
        """Token rows waiting to be computed (a replica's load, `cloud.ray_cloud`)."""
        with self._cv:
            return sum(job.remaining for job in self._queue)

    def load(self) -> tuple[int, int]:
        """(running, waiting): requests taken into a pass (a chunked one until its last chunk), and
        requests queued for their first pass."""
        with self._cv:
            running = sum(job.running for job in self._queue)
            return running, len(self._queue) - running

    def submit(self, session: Session, req: Forward) -> Future:
        """Queue a validated request; the future's result is a `Done` (or the error that failed it)."""
        job = Job(session, req)
        with self._cv:
            if self._stopped:
                raise RuntimeError("the scheduler is stopped")
            self._queue.append(job)
            self._cv.notify()
        return job.future

    async def run(self, session: Session, req: Forward) -> Done:
        return await asyncio.wrap_future(self.submit(session, req))

    def take(self) -> PassPlan:
        """The next pass: its pieces (job, rows to run) in queue order (call with the lock held).
        Requests of closed sessions leave the queue here, failed, never computed."""
        cfg, batch, rows, sessions = self.config, PassPlan(), 0, set()
        # after a pass that ran a chunk of a long request, the next one runs only the other steps (if
        # any wait): a step that arrived during a chunk's pass waits for that pass, not also for the next chunk
        defer_long = self._ran_long and any(not self.long(j) for j in self._queue)
        for job in list(self._queue):
            if self._drop_if_gone(job):
                continue
            if len(batch) == cfg.max_batch:
                break
            sid = job.session.id
            if sid in sessions:  # one piece per session and pass; its later requests wait behind it
                continue
            sessions.add(sid)
            if defer_long and self.long(job):
                continue
            n = self._piece(job, cfg.max_batch_tokens - rows, alone=not batch)
            if n is None or not self._start(job):
                continue
            batch.pieces.append(Piece(job, n))
            rows += n
        self._ran_long = any(self.long(p.job) for p in batch)
        return batch

    def _drop_if_gone(self, job: Job) -> bool:
        """A request whose session was closed (or whose waiter went away) leaves the queue, failed."""
        if not (job.future.cancelled() or job.session.closed):
            return False
        self._queue.remove(job)
        if not job.future.cancelled():
            job.future.set_exception(ProtocolError(ErrorCode.UNKNOWN_SESSION, "the session was closed"))
        return True

    def _piece(self, job: Job, room: int, alone: bool) -> int | None:
        """The rows of `job` this pass runs, with `room` rows left in it (None: it waits for another pass).
        A causal request runs at most one chunk, cut to the room left; a larger tree runs only `alone`."""
        cfg = self.config
        n = min(job.remaining, cfg.prefill_chunk) if job.chunkable else job.remaining
        if n > room:
            if job.chunkable and room > 0:
                n = room
            elif not alone:
                return None
        return n

    def _start(self, job: Job) -> bool:
        """Mark the job as running (False: it was cancelled, e.g. the server is shutting down, and leaves
        the queue, never computed)."""
        if job.running:
            return True
        if not job.future.set_running_or_notify_cancel():
            self._queue.remove(job)
            return False
        job.running = True
        return True

    def long(self, job: Job) -> bool:
        """A causal request that runs in chunks (longer than one)."""
        return job.chunkable and job.rows > self.config.prefill_chunk

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    for job in self._queue:
                        job.future.set_exception(RuntimeError("the cloud is shutting down"))
                    self._queue.clear()
                    return
                plan = self.take()
            if plan:
                self._answer(self.runner.run(plan))

    def _answer(self, report: PassReport) -> None:
        """The pass's finished requests answered, its failed ones failed (they leave the queue)."""
        if report.timing is not None:
            self.passes += 1
            if self.on_pass is not None:
                self.on_pass(report.timing)
        for failed in report.failed:
            self._leave(failed.job)
            failed.job.future.set_exception(failed.error)
        for done in report.finished:
            job = done.job
            self._leave(job)
            queue_s, compute_s = job.first_pass - job.submitted, done.end - job.submitted
            job.future.set_result(Done(done.outputs, queue_s, compute_s, job.passes))

    def _leave(self, job: Job) -> None:
        with self._cv:
            if job in self._queue:
                self._queue.remove(job)

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(10)
