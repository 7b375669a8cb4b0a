"""What one pass of the cloud's layers holds, and the runner that executes it.

The scheduler decides a pass (`Scheduler.take` returns a `PassPlan`): a `Piece` is the rows of one
queued request (`Job`) that the pass runs; the job's first piece makes its `Step` (the request made
ready for the layers). `PassRunner.run` executes a plan in three phases (the `PassTiming` that the
metrics export): begin (a job's first piece restores, wipes, crops and keeps its session's cache and
moves its rows to the device), layers (one pass over every piece: rows packed for the dense layers,
attention per session on its own cache), finish (a job whose last rows ran applies its session's
cache policy and brings its outputs to host memory). It reports what finished and what failed; the
scheduler answers the requests."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from splitlm.cloud.metrics import PassTiming
from splitlm.cloud.sessions import Session
from splitlm.model.device import to_device, to_host
from splitlm.model.shards import CloudModel
from splitlm.transport.messages import Forward
from splitlm.transport.policy import CachePolicy

log = logging.getLogger(__name__)


@dataclass
class Step:
    """One request made ready for the layers: the session's cache restored, cropped and kept, the rows
    on the model's device. A causal request (no mask) may run in chunks over several passes."""

    session: Session
    req: Forward
    hidden: torch.Tensor  # [1, C + T, D] float32 (the residual stream)
    positions: torch.Tensor  # [C + T]
    mask: torch.Tensor | None  # [C + T, C + T] bool, None = causal
    start: int  # the cache's length before the step (after crop and keep)
    done: int = 0  # rows already run
    outs: list[torch.Tensor] = field(default_factory=list)  # their outputs, [rows, D] each

    @property
    def rows(self) -> int:
        return self.hidden.shape[1]

    @property
    def chunkable(self) -> bool:
        """Whether its rows may run in several passes: only when they are causal among themselves
        (each chunk then sees every earlier row in the cache, as one pass would)."""
        return self.req.mask is None


@dataclass
class Outputs:
    """A finished step's reply tensors, in host memory: tail-local `hidden` [T, D]; split-head `hidden`
    (h[:d]) [R, d] and `logits` [R, S]."""

    hidden: torch.Tensor
    logits: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.hidden.nbytes + (0 if self.logits is None else self.logits.nbytes)


@dataclass(eq=False)  # identity: the queue finds and removes a job by itself, never by comparing tensors
class Job:
    session: Session
    req: Forward
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    step: Step | None = None  # once its first piece runs
    first_pass: float | None = None
    passes: int = 0
    running: bool = False  # taken into a pass (its future can no longer be cancelled)

    @property
    def rows(self) -> int:
        return self.req.hidden.shape[0]

    @property
    def remaining(self) -> int:
        return self.rows - (self.step.done if self.step is not None else 0)

    @property
    def chunkable(self) -> bool:
        return self.req.mask is None


@dataclass
class Piece:
    """The next `rows` rows of `job` (all of them, or a chunk of a causal request)."""

    job: Job
    rows: int


@dataclass
class PassPlan:
    """One pass: at most one piece per session, in queue order."""

    pieces: list[Piece] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def __iter__(self):
        return iter(self.pieces)


def context_mask(c: int, mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """Visibility among C context rows (causal) followed by T new tokens (which see all context)."""
    if c == 0:
        return mask
    full = torch.ones(c + t, c + t, dtype=torch.bool).tril()  # [C + T, C + T]
    if mask is not None:
        full[c:, c:] = mask
    return full


def begin_step(model: CloudModel, session: Session, req: Forward) -> Step:
    """Restore (unseal), wipe, crop, keep and tighten, in the order of docs/protocol.md §6.1."""
    ctl = req.control
    device = next(model.parameters()).device
    session.restore(ctl.key, device)  # raises SEALED_KEY before any state changes
    cache = session.cache
    if not ctl.cache:
        cache.clear()
    if req.crop is not None:
        cache.crop(req.crop)
    if req.keep is not None:
        cache.keep(req.keep)
    if ctl.window is not None and ctl.window < session.policy.retention:  # after keep: no block is cut
        session.tighten(CachePolicy("window", ctl.window))
    mask = context_mask(req.context, req.mask, req.new_tokens)
    return Step(
        session,
        req,
        to_device(req.hidden, device, torch.float32)[None],
        to_device(req.positions, device),
        None if mask is None else to_device(mask, device),
        cache.length,
    )


def run_layers(model: CloudModel, pieces: list[tuple[Step, int]]) -> None:
    """One pass of the layers over the next `n` rows of each step (at most one piece per session):
    rows packed for the dense layers, attention per session on its own cache (`forward_packed`)."""
    xs, positions, masks, caches = [], [], [], []
    for step, n in pieces:
        lo, hi = step.done, step.done + n
        whole = lo == 0 and hi == step.rows
        if not whole and not step.chunkable:
            raise ValueError("only a causal request runs in chunks")
        xs.append(step.hidden[:, lo:hi])  # [1, n, D]
        positions.append(step.positions[lo:hi])
        masks.append(step.mask if whole else None)  # a chunk of causal rows: causal, all earlier rows cached
        caches.append(step.session.cache)
    outs = model.middle.forward_packed(xs, positions, masks, caches)
    for (step, n), out in zip(pieces, outs, strict=True):
        step.outs.append(out[0])
        step.done += n


def finish_step(model: CloudModel, step: Step) -> Outputs:
    """After the step's last rows ran: apply the policy (wipe, trim or seal); the reply's tensors in
    host memory (the one copy back)."""
    session, req = step.session, step.req
    cache, c = session.cache, req.context
    out = (step.outs[0] if len(step.outs) == 1 else torch.cat(step.outs))[c:]  # [T, D]
    cache.pending_start = step.start + c  # the T new tokens; context rows are history
    session.tokens_processed += req.new_tokens
    session.apply_policy(req.control.key)
    if not model.split_head:
        return Outputs(to_host(out))
    from splitlm.model.splithead import cloud_head

    h_end, logits = cloud_head(model, out if req.rows is None else out[req.rows], session.vocab)
    return Outputs(to_host(h_end), to_host(logits))


@dataclass
class Finished:
    job: Job
    outputs: Outputs
    end: float  # time.perf_counter() when its outputs were ready


@dataclass
class Failed:
    job: Job
    error: BaseException


@dataclass
class PassReport:
    """What one pass did: the jobs it finished, those that failed (alone, or all of the pass's when the
    layers failed), and its timing (None: nothing ran through the layers)."""

    finished: list[Finished] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    timing: PassTiming | None = None


class PassRunner:
    """Executes pass plans on `model`'s layers (on the scheduler's compute thread)."""

    def __init__(self, model: CloudModel):
        self.model = model

    @torch.inference_mode()
    def run(self, plan: PassPlan) -> PassReport:
        report = PassReport()
        start = time.perf_counter()
        ready = self.begin(plan, start, report)
        began = time.perf_counter()
        if not ready:
            return report
        try:
            run_layers(self.model, [(p.job.step, p.rows) for p in ready])
        except Exception as e:  # noqa: BLE001 - a bug in the pass fails its requests, not the server
            log.exception("a pass of %d request(s) failed", len(ready))
            report.failed += [Failed(p.job, e) for p in ready]
            return report
        ran = time.perf_counter()
        for p in ready:
            p.job.passes += 1
            if not p.job.remaining:
                self.finish(p.job, report)
        rows = sum(p.rows for p in ready)
        report.timing = PassTiming(len(ready), rows, began - start, ran - began, time.perf_counter() - ran)
        return report

    def begin(self, plan: PassPlan, start: float, report: PassReport) -> list[Piece]:
        """The pieces whose steps are ready (a job's first piece begins its step; one that fails alone)."""
        ready = []
        for piece in plan:
            job = piece.job
            if job.step is None:
                try:
                    job.step = begin_step(self.model, job.session, job.req)
                except Exception as e:  # noqa: BLE001 - e.g. SEALED_KEY: this request fails, the others run
                    report.failed.append(Failed(job, e))
                    continue
                job.first_pass = start
            ready.append(piece)
        return ready

    def finish(self, job: Job, report: PassReport) -> None:
        """The job's last rows ran: its outputs (or the error that failed it)."""
        try:
            outputs = finish_step(self.model, job.step)
        except Exception as e:  # noqa: BLE001
            report.failed.append(Failed(job, e))
            return
        report.finished.append(Finished(job, outputs, time.perf_counter()))
