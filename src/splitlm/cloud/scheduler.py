"""The batching scheduler: one compute thread runs the ready steps of all sessions in shared passes.

Requests arrive from the event loop (`submit`, thread-safe); the compute thread takes, in arrival
order, as many as fit one pass (`BatchConfig`: at most `max_batch` sessions and `max_batch_tokens`
rows, a larger request runs alone; at most one request per session, so a session's requests stay
in order) and runs them with `compute_batch`: their rows packed for the dense layers, attention per
session on its own cache. While a pass runs, new requests queue and join the next one, so batches
form by themselves under load and a lone edge never waits for company (no gathering delay).

`max_batch = 1` is the old one-request-at-a-time cloud (and the baseline of `splitlm loadtest`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from splitlm.cloud.sessions import Session, compute_batch
from splitlm.model.shards import CloudModel
from splitlm.transport.messages import Forward

log = logging.getLogger(__name__)


@dataclass
class BatchConfig:
    max_batch: int = 16  # sessions per pass (1 = no batching)
    max_batch_tokens: int = 2048  # rows per pass (context rows included); a larger request runs alone

    def __post_init__(self):
        if self.max_batch < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_batch and max_batch_tokens must be >= 1")


@dataclass
class Job:
    session: Session
    req: Forward
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def rows(self) -> int:
        return self.req.hidden.shape[0]


@dataclass
class Done:
    """A request's outcome: its reply tensors, how long it waited for a pass and how long it took in all."""
    tensors: dict[str, torch.Tensor]
    queue_s: float
    compute_s: float  # from submit to output (queue_s included)
    batch: int  # requests in its pass


class Scheduler:
    def __init__(self, model: CloudModel, config: BatchConfig | None = None, on_pass=None):
        """`on_pass(sessions, rows, seconds)`: called on the compute thread after each pass (metrics)."""
        self.model, self.config = model, config or BatchConfig()
        self.on_pass = on_pass
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="splitlm-compute")
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._queue)

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

    def take(self) -> list[Job]:
        """The next pass (call with the lock held and the queue not empty): FIFO, as many requests as
        fit the limits; a request of a session already in the pass (or behind one that was skipped)
        waits for the next pass."""
        cfg, batch, rows, sessions = self.config, [], 0, set()
        for job in self._queue:
            if len(batch) == cfg.max_batch:
                break
            sid = job.session.id
            if sid in sessions or (batch and rows + job.rows > cfg.max_batch_tokens):
                sessions.add(sid)  # keeps this session's later requests behind this one
                continue
            batch.append(job)
            sessions.add(sid)
            rows += job.rows
        taken = set(map(id, batch))
        self._queue = deque(j for j in self._queue if id(j) not in taken)
        return batch

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
                batch = self.take()
            start = time.perf_counter()
            try:
                answers = compute_batch(self.model, [(j.session, j.req) for j in batch])
            except Exception as e:  # noqa: BLE001 - a bug in the pass fails its requests, not the server
                log.exception("a pass of %d request(s) failed", len(batch))
                answers = [e] * len(batch)
            end = time.perf_counter()
            if self.on_pass is not None:
                self.on_pass(len(batch), sum(j.rows for j in batch), end - start)
            for job, answer in zip(batch, answers, strict=True):
                if isinstance(answer, Exception):
                    job.future.set_exception(answer)
                else:
                    job.future.set_result(Done(answer, start - job.submitted, end - job.submitted, len(batch)))

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(10)
