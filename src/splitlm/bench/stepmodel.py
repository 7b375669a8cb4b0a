"""The step-time model: time per decoding step is linear in the round-trip time.

    t_step(RTT) = α·RTT + β

α ≈ 1 for a system that waits out one full round trip per step (sequential split decoding),
≈ 0 for one that never touches the network (the full model run locally); β is the compute and
overhead of a step that the network does not hide. With τ tokens per step (tokens per round
trip), throughput follows as tok/s = τ / t_step(RTT).

Fitted by ordinary least squares over an RTT sweep; the error that matters is the
cross-validated one: leave one RTT out, fit on the rest, predict the one left out.
Pure Python (no numpy needed): a handful of points per mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class StepFit:
    alpha: float  # seconds of step time per second of RTT
    beta_s: float  # seconds per step at zero RTT
    rtts_ms: list[float] = field(default_factory=list)
    steps_s: list[float] = field(default_factory=list)  # measured step times the fit used
    loo_rel_errors: list[float] = field(default_factory=list)  # |pred - meas| / meas, one per point left out

    def step_s(self, rtt_ms: float) -> float:
        """Predicted seconds per decoding step at `rtt_ms`."""
        return self.alpha * rtt_ms / 1000 + self.beta_s

    def tok_s(self, rtt_ms: float, tokens_per_step: float = 1.0) -> float:
        """Predicted decode throughput at `rtt_ms` when each step yields `tokens_per_step` tokens."""
        t = self.step_s(rtt_ms)
        return tokens_per_step / t if t > 0 else float("inf")

    @property
    def loo_mean_rel_error(self) -> float | None:
        return sum(self.loo_rel_errors) / len(self.loo_rel_errors) if self.loo_rel_errors else None

    @property
    def loo_max_rel_error(self) -> float | None:
        return max(self.loo_rel_errors) if self.loo_rel_errors else None

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "loo_mean_rel_error": self.loo_mean_rel_error,
            "loo_max_rel_error": self.loo_max_rel_error,
        }


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Fit y = a·x + b by ordinary least squares; returns (a, b). Needs two distinct x values."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values but {len(ys)} y values")
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs at least two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a line needs at least two distinct x values")
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return a, my - a * mx


def fit_step_time(rtts_ms: Sequence[float], steps_s: Sequence[float]) -> StepFit:
    """Fit t_step = α·RTT + β to measured (RTT in ms, seconds per step) points.

    Leave-one-out errors are computed when at least three points remain to fit two parameters
    on (points with a repeated RTT count as separate points).
    """
    rtts, steps = [float(r) for r in rtts_ms], [float(s) for s in steps_s]
    a, b = least_squares([r / 1000 for r in rtts], steps)
    loo: list[float] = []
    if len(rtts) >= 3:
        for i in range(len(rtts)):
            xs = [r / 1000 for j, r in enumerate(rtts) if j != i]
            ys = [s for j, s in enumerate(steps) if j != i]
            try:
                ai, bi = least_squares(xs, ys)
            except ValueError:  # the rest share one RTT: nothing to cross-validate with
                loo = []
                break
            predicted = ai * rtts[i] / 1000 + bi
            loo.append(abs(predicted - steps[i]) / steps[i] if steps[i] > 0 else float("inf"))
    return StepFit(a, b, rtts, steps, loo)
