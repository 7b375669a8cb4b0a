"""The load test's sessions: one session's generation timed step by step, N of them at once, and
their figures (throughput, step latency, time to first token; a long prefill's interference with them)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from splitlm.edge.request import GenerationRequest

STEPS_BEFORE_PREFILL = 4


@dataclass
class SessionRun:
    tokens: list[int] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each decoding step
    start: float = 0.0
    first: float = 0.0  # when the first token arrived
    end: float = 0.0
    cloud_compute_s: float = 0.0  # the RESULTs' compute_s, summed
    error: str | None = None

    @property
    def latencies(self) -> list[float]:
        return [b - a for a, b in self.steps]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


class Countdown:
    """Set once `n` parties have arrived (a session that ends early arrives on its way out)."""

    def __init__(self, n: int):
        self.n, self.lock, self.event = n, threading.Lock(), threading.Event()

    def arrive(self) -> None:
        with self.lock:
            self.n -= 1
            if self.n <= 0:
                self.event.set()


def decode(
    edge, ids: list[int], max_new: int, spec, run: SessionRun, barrier=None, after_steps: Countdown | None = None
) -> None:
    """One session's generation, timing each decoding step; errors are recorded, not raised.
    `after_steps`: arrived at after STEPS_BEFORE_PREFILL decoding steps (or at the end)."""
    if barrier is not None:
        barrier.wait()
    run.start = last = time.perf_counter()
    first, arrived = True, after_steps is None
    try:
        for tokens, stats in edge.generate_ids(GenerationRequest(ids, max_new, stop_at_eos=False, spec=spec)):
            run.cloud_compute_s = stats.cloud_compute_s
            now = time.perf_counter()
            if not first:
                run.steps.append((last, now))
                if not arrived and len(run.steps) == STEPS_BEFORE_PREFILL:
                    after_steps.arrive()
                    arrived = True
            else:
                run.first = now
            first, last = False, now
            run.tokens.extend(tokens)
    except Exception as e:  # noqa: BLE001 - a load test counts failures
        run.error = f"{type(e).__name__}: {e}"
    finally:
        if not arrived:
            after_steps.arrive()
    run.end = time.perf_counter()


def concurrently(edges: list, prompts: list[list[int]], max_new: int, spec) -> list[SessionRun]:
    """The prompts' generations at once, session i on `edges[i]`."""
    runs = [SessionRun() for _ in prompts]
    barrier = threading.Barrier(len(prompts))
    threads = [
        threading.Thread(target=decode, args=(edge, p, max_new, spec, r, barrier), daemon=True)
        for edge, p, r in zip(edges, prompts, runs, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs


def quantiles(values: list[float], scale: float = 1.0, digits: int = 1) -> dict:
    return {f"p{q}": None if (v := percentile(values, q)) is None else round(v * scale, digits) for q in (50, 95, 99)}


def steady(runs: list[SessionRun], reference: list[list[int]]) -> dict:
    lat = [x for r in runs for x in r.latencies]
    wall = max(r.end for r in runs) - min(r.start for r in runs)
    tokens = sum(len(r.tokens) for r in runs)
    per_session = [len(r.tokens) / (r.end - r.start) for r in runs if r.end > r.start and r.tokens]
    identical = sum(r.tokens == ref for r, ref in zip(runs, reference, strict=True))
    return {
        "sessions": len(runs),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "per_session_tok_s": round(sum(per_session) / len(per_session), 2) if per_session else None,
        "per_session_tok_s_min": round(min(per_session), 2) if per_session else None,
        "step_latency_ms": quantiles(lat, 1000),
        "steps": len(lat),
        "ttft_s": quantiles([r.first - r.start for r in runs if r.first], 1, 3),
        "errors": sum(r.error is not None for r in runs),
        "error_messages": sorted({r.error for r in runs if r.error})[:5],
        "identical_outputs": identical,
    }


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def interference(
    edges: list, edge, prompts: list[list[int]], long_prompt: list[int], max_new: int, spec, chunk: int
) -> dict:
    """N-1 sessions decode (session i on `edges[i]`); after each made a few steps, one session prefills
    `long_prompt` on `edge`. First, on the idle cloud, the compute of one prefill chunk (`chunk` tokens
    alone: the RESULT's compute_s)."""
    alone = SessionRun()
    decode(edge, long_prompt[:chunk], 1, spec, alone)
    runs = [SessionRun() for _ in prompts]
    barrier = threading.Barrier(len(prompts))
    ready = Countdown(len(prompts))
    threads = [
        threading.Thread(target=decode, args=(e, p, max_new, spec, r, barrier, ready), daemon=True)
        for e, p, r in zip(edges[: len(prompts)], prompts, runs, strict=True)
    ]
    for t in threads:
        t.start()
    prefill = SessionRun()
    if ready.event.wait(300):
        decode(edge, long_prompt, 1, spec, prefill)
    else:
        prefill.error = "the decoders did not reach the prefill point"
    prefill_error_s = prefill.end - prefill.start if prefill.error else None  # a refusal: how soon it came
    for t in threads:
        t.join()
    p0, p1 = prefill.start, prefill.end
    before = [b - a for r in runs for a, b in r.steps if b <= p0]
    during = [b - a for r in runs for a, b in r.steps if b > p0 and a < p1]
    worst, typical = (max(during) if during else None), percentile(before, 50)
    chunk_ms = alone.cloud_compute_s * 1000 if alone.error is None else None
    return {
        "prefill_tokens": len(long_prompt),
        "prefill_s": round(p1 - p0, 3),
        "prefill_error": prefill.error,
        "prefill_error_after_s": None if prefill_error_s is None else round(prefill_error_s, 3),
        "chunk_tokens": min(chunk, len(long_prompt)),
        "chunk_compute_ms": round(chunk_ms, 1) if chunk_ms else None,
        "decode_p50_before_ms": ms(typical),
        "decode_p50_during_ms": ms(percentile(during, 50)),
        "decode_max_during_ms": ms(worst),
        "steps_during": len(during),
        "max_delay_ms": ms(worst - typical) if worst is not None and typical is not None else None,
        "max_delay_chunks": round((worst - typical) * 1000 / chunk_ms, 2) if chunk_ms and during and typical else None,
        "errors": sum(r.error is not None for r in runs),
    }
