"""What one pass of the cloud's layers holds: the scheduler decides it (`Scheduler.take` returns a
`PassPlan`), the runner executes it (`cloud.runner`). A `Job` is one queued request; a `Piece` is the
rows of it one pass runs; its `Step` is the request made ready for the layers by its first piece."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from splitlm.cloud.sessions import Session
from splitlm.transport.messages import Forward


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
