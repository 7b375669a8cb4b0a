"""The batching scheduler: one compute thread runs the ready steps of all sessions in shared passes.

Requests arrive from the event loop (`submit`, thread-safe) and queue in arrival order. Each pass
takes each waiting session's first request, in that order, up to `max_batch` sessions (a session's
requests stay in order), and gives out its row budget (`max_batch_tokens`) **decode first**: the
decoding steps (trees, lookahead windows, short causal steps) get their rows, then prompt chunks
(causal requests of more than `DECODE_ROWS` rows: prompts, replayed context) share what is left, at
most `prefill_chunk` rows in all. A longer prompt therefore runs in chunks over several passes,
keeping its place in the queue, and after a pass with prompt rows the next pass runs only the
decoding steps that wait (when there are any): a step that arrives during a chunk's pass waits for
that pass but not also for the next chunk, so a 2,048-token prefill delays the other sessions' steps
by about one chunk's compute, not by the whole prefill. The oldest request of the queue always
progresses (a prompt at its head gets its chunk whatever the steps take). A tree larger than the
budget runs alone. The defaults (docs/devices.md) are measured on this project's CPU: a chunk of 64
rows costs about as much as a 16-session decoding pass of the bundled model.
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
from dataclasses import dataclass, replace

import torch

from splitlm.cloud.runner import Job, Outputs, PassPlan, PassReport, PassRunner, Piece
from splitlm.cloud.sessions import Session
from splitlm.model.shards import CloudModel
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.messages import Forward

DECODE_ROWS = 16  # a causal request of more rows is a prompt (chunked, after the decode steps); fewer: a step
# rows per pass by device when `max_batch_tokens` is 0: on the 2-core CPU a pass of more than ~64 rows
# costs more per row (pass cost 0.94 ms per row at 64, 1.40 at 128 and 256), so 8 trees of 25 rows in one
# pass took longer than in 8 passes of their own; an accelerator computes 2,048 rows in about the time of one
CPU_PASS_TOKENS = 64
ACCELERATOR_PASS_TOKENS = 2048


@dataclass
class BatchConfig:
    max_batch: int = 16  # sessions per pass (1 = no batching)
    max_batch_tokens: int = 0  # rows per pass (context rows included; a larger tree runs alone); 0 = by device
    prefill_chunk: int = 64  # prompt rows per pass, all prompts together (longer prompts are chunked)

    def __post_init__(self):
        if min(self.max_batch, self.prefill_chunk) < 1 or self.max_batch_tokens < 0:
            raise ValueError("max_batch and prefill_chunk must be >= 1, max_batch_tokens >= 0 (0 = by device)")

    def for_device(self, device: torch.device) -> BatchConfig:
        """With `max_batch_tokens` 0: the rows per pass that suit `device` (`CPU_PASS_TOKENS` on a CPU)."""
        if self.max_batch_tokens:
            return self
        rows = CPU_PASS_TOKENS if device.type == "cpu" else ACCELERATOR_PASS_TOKENS
        return replace(self, max_batch_tokens=rows)


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
        self.model = model
        self.config = (config or BatchConfig()).for_device(next(model.middle.parameters()).device)
        self.runner = PassRunner(model)
        self.on_pass = on_pass
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._ran_prompt = False  # the last pass ran prompt rows
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
        """The next pass (call with the lock held): each waiting session's first request, in queue order,
        up to `max_batch` sessions; decode steps (every request but a prompt, `prompt`) get their rows
        first, within `max_batch_tokens`; prompt chunks then share what is left, at most `prefill_chunk`
        rows in all (the oldest request of the queue, if a prompt, always gets its chunk, so prompts
        never starve behind decoding). Requests of closed sessions leave the queue here, failed, never
        computed."""
        cfg, heads = self.config, self.heads()
        # after a pass that ran prompt rows, the next one runs only the decode steps (if any wait): a step
        # that arrived during a chunk's pass waits for that pass, not also for the next chunk
        defer_prompts = self._ran_prompt and any(not self.prompt(j) for j in heads)
        plan, rows, taken = PassPlan(), 0, []
        for job in heads:
            if len(taken) == cfg.max_batch:
                break
            if self.prompt(job):
                if not defer_prompts:
                    taken.append(job)
                continue
            n = self._piece(job, cfg.max_batch_tokens - rows, alone=not plan)
            if n is not None and self._start(job):
                taken.append(job)
                plan.pieces.append(Piece(job, n))
                rows += n
        self.add_prompt_chunks(plan, [j for j in taken if self.prompt(j)], heads[0] if heads else None, rows)
        self._ran_prompt = any(self.prompt(p.job) for p in plan)
        return plan

    def heads(self) -> list[Job]:
        """Each waiting session's first request, in queue order (a session's later requests wait behind
        it); requests of closed sessions leave the queue, failed."""
        heads, seen = [], set()
        for job in list(self._queue):
            if self._drop_if_gone(job) or job.session.id in seen:
                continue
            seen.add(job.session.id)
            heads.append(job)
        return heads

    def add_prompt_chunks(self, plan: PassPlan, prompts: list[Job], oldest: Job | None, rows: int) -> None:
        """Chunks of `prompts` into what the decode steps (`rows`) left of the pass, `prefill_chunk` rows in
        all; the `oldest` request of the queue gets its chunk whatever is left."""
        share = min(self.config.prefill_chunk, self.config.max_batch_tokens - rows)
        for job in prompts:
            n = min(job.remaining, self.config.prefill_chunk if job is oldest else share)
            if n > 0 and self._start(job):
                plan.pieces.append(Piece(job, n))
                share -= n

    def prompt(self, job: Job) -> bool:
        """A prompt (or replayed context): a causal request of more rows than a decoding step sends."""
        return job.chunkable and job.rows > DECODE_ROWS

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
