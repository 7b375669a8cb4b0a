"""The step trace of real edges: what every FORWARD of a generation carried, but its activations.

`record_trace` runs real `Edge.generate_ids` calls (one prompt at a time) with a `TraceRecorder`
as the edge's observer (`Edge.observer`, `splitlm.edge.link.StepObserver`): per FORWARD the rows
(context + new tokens), positions, tree mask, keep, crop, control tuple, how many replies the
session had taken when it was sent (fewer than its index when steps are pipelined), the tokens
the edge produced once its reply came back, and the cloud's cache length after it. The virtual
edges of `splitlm.bench.virtual` replay it with random activations of the right shape.

A trace depends on the edge (its shard fingerprint), the spec mode, the prompts, the RTT it was
recorded at (the step budget sizes trees from the measured link), the tokens per prompt and the
wire dtype; `trace_key` names it and `cached_trace_path` files it under `$SPLITLM_CACHE/traces/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from splitlm import SplitLMError
from splitlm.edge.request import GenerationRequest
from splitlm.transport.frames import pack_mask, unpack_mask
from splitlm.transport.messages import Forward, Result

log = logging.getLogger(__name__)

SCHEMA = "splitlm.trace/1"


@dataclass
class TracedStep:
    """One recorded FORWARD (everything but the activations)."""

    rows: int  # C + T rows of hidden states
    context: int  # C: re-sent history rows before the T new tokens
    positions: list[int]  # [C + T]
    mask: str | None = None  # [T, T] visibility as packed bits (hex); None = causal
    keep: list[int] | None = None
    crop: int | None = None
    cache: bool = True  # the control tuple's flagCache
    window: int | None = None
    dtype: str | None = None  # the reply's wire dtype
    logit_rows: list[int] | None = None  # split-head: the new tokens whose logits were asked for
    after: int = 0  # replies the session had taken when this was sent
    accepted: int = 0  # tokens the edge produced once this step's reply came back
    cache_len: int = 0  # the cloud's cache entries after it

    @classmethod
    def of(cls, request: Forward, after: int) -> TracedStep:
        mask = None if request.mask is None else pack_mask(request.mask).hex()
        c = request.control
        return cls(
            request.hidden.shape[0],
            request.context,
            [int(p) for p in request.positions],
            mask,
            request.keep,
            request.crop,
            c.cache,
            c.window,
            c.dtype,
            request.rows,
            after,
        )

    def mask_tensor(self) -> torch.Tensor | None:
        """The [T, T] bool mask (None = causal)."""
        return None if self.mask is None else unpack_mask(bytes.fromhex(self.mask), self.rows - self.context)


@dataclass
class PromptTrace:
    """One generation: its prompt's id and length and the FORWARDs it sent, in order."""

    prompt_id: str
    prompt_tokens: int
    steps: list[TracedStep] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.accepted for s in self.steps)


@dataclass
class Trace:
    """The recorded generations of one edge, and the conditions they were recorded in."""

    fingerprint: str  # the edge shard's
    hidden_size: int
    spec: str
    rtt_ms: float
    max_new_tokens: int
    wire_dtype: str
    cache_policy: str
    prompts_digest: str
    prompts: list[PromptTrace] = field(default_factory=list)
    schema: str = SCHEMA

    @property
    def steps(self) -> int:
        return sum(len(p.steps) for p in self.prompts)

    def summary(self) -> dict:
        """What a result document says about the trace replayed."""
        decode = [s for p in self.prompts for s in p.steps[1:]]  # after each prompt's first (prefill) forward
        tokens = sum(p.tokens for p in self.prompts)
        return {
            "fingerprint": self.fingerprint,
            "spec": self.spec,
            "rtt_ms": self.rtt_ms,
            "max_new_tokens": self.max_new_tokens,
            "wire_dtype": self.wire_dtype,
            "prompts": len(self.prompts),
            "forwards": self.steps,
            "tokens": tokens,
            "tokens_per_forward": round(tokens / self.steps, 3) if self.steps else None,
            "decode_rows_per_forward": round(sum(s.rows for s in decode) / len(decode), 2) if decode else None,
            "prompt_rows_mean": round(sum(p.prompt_tokens for p in self.prompts) / len(self.prompts), 1)
            if self.prompts
            else None,
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), separators=(",", ":")))
        tmp.replace(path)  # a reader never sees half a trace
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SplitLMError(f"cannot read the step trace {path}: {e}") from None
        if doc.get("schema") != SCHEMA:
            raise SplitLMError(f"{path}: not a {SCHEMA} step trace")
        prompts = [
            PromptTrace(p["prompt_id"], p["prompt_tokens"], [TracedStep(**s) for s in p["steps"]])
            for p in doc.pop("prompts")
        ]
        return cls(**doc, prompts=prompts)


class TraceRecorder:
    """A `StepObserver` that records one generation at a time (`take` ends it)."""

    def __init__(self):
        self.steps: list[TracedStep] = []
        self.taken = 0  # replies taken in this generation

    def sent(self, request: Forward) -> None:
        self.steps.append(TracedStep.of(request, self.taken))

    def received(self, result: Result | None) -> None:
        self.taken += 1
        if result is not None and self.taken <= len(self.steps):
            self.steps[self.taken - 1].cache_len = result.cache_len

    def accepted(self, n: int) -> None:
        """The edge produced `n` tokens (credited to the last reply taken)."""
        if self.taken:
            self.steps[self.taken - 1].accepted += n

    def take(self) -> list[TracedStep]:
        steps, self.steps, self.taken = self.steps, [], 0
        return steps


def spec_label(spec) -> str:
    """A `SpecConfig` as one string (every field: two traces differ when any knob does)."""
    return json.dumps(asdict(spec), sort_keys=True, separators=(",", ":"))


def prompts_digest(prompts: list[tuple[str, list[int]]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def trace_key(fingerprint: str, spec: str, digest: str, rtt_ms: float, max_new_tokens: int, wire_dtype: str) -> str:
    """The name of a trace recorded under these conditions."""
    text = json.dumps([SCHEMA, fingerprint, spec, digest, float(rtt_ms), max_new_tokens, wire_dtype])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_trace_path(key: str) -> Path:
    """`$SPLITLM_CACHE/traces/<key>.json`."""
    from splitlm.model.loading import cache_root

    return cache_root() / "traces" / f"{key}.json"


def record_trace(edge, prompts: list[tuple[str, list[int]]], spec, max_new_tokens: int, rtt_ms: float) -> Trace:
    """Generate each prompt (`(id, token ids)`) alone on `edge` (greedy, all `max_new_tokens` tokens)
    and record its FORWARDs. `rtt_ms`: the RTT of the link `edge` is behind (recorded, not applied)."""
    from splitlm.progress import track

    recorder = TraceRecorder()
    previous, edge.observer = edge.observer, recorder
    trace = Trace(
        edge.model.manifest.fingerprint,
        edge.cfg.hidden_size,
        spec_label(spec),
        rtt_ms,
        max_new_tokens,
        edge.wire_dtype,
        str(edge.cache_policy),
        prompts_digest(prompts),
    )
    try:
        for prompt_id, ids in track(prompts, "trace: recording", unit="prompt"):
            for new, _ in edge.generate_ids(GenerationRequest(ids, max_new_tokens, stop_at_eos=False, spec=spec)):
                recorder.accepted(len(new))
            trace.prompts.append(PromptTrace(prompt_id, len(ids), recorder.take()))
    finally:
        edge.observer = previous
    log.info(
        "[trace] %d prompts, %d forwards, %.2f tokens per forward",
        len(trace.prompts),
        trace.steps,
        trace.summary()["tokens_per_forward"] or 0,
    )
    return trace
