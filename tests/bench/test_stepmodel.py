"""The step-time model t_step = α·RTT + β: least squares and leave-one-out error on synthetic data."""

from __future__ import annotations

import random

import pytest

from splitlm.bench.stepmodel import fit_step_time, least_squares


def test_exact_line_is_recovered_with_zero_loo_error():
    rtts = [20, 40, 80, 120, 200]
    steps = [1.0 * r / 1000 + 0.062 for r in rtts]  # α = 1, β = 62 ms
    fit = fit_step_time(rtts, steps)
    assert fit.alpha == pytest.approx(1.0)
    assert fit.beta_s == pytest.approx(0.062)
    assert len(fit.loo_rel_errors) == 5
    assert fit.loo_max_rel_error == pytest.approx(0.0, abs=1e-9)
    assert fit.step_s(300) == pytest.approx(0.362)
    assert fit.tok_s(300, tokens_per_step=2.0) == pytest.approx(2 / 0.362)


def test_noisy_line_is_recovered_within_noise():
    rng = random.Random(0)
    rtts = [r for r in (10, 20, 40, 80, 120, 160, 200) for _ in range(3)]
    steps = [(0.9 * r / 1000 + 0.05) * (1 + rng.uniform(-0.02, 0.02)) for r in rtts]
    fit = fit_step_time(rtts, steps)
    assert fit.alpha == pytest.approx(0.9, abs=0.05)
    assert fit.beta_s == pytest.approx(0.05, abs=0.005)
    assert 0 < fit.loo_mean_rel_error < 0.03


def test_local_mode_has_zero_slope():
    fit = fit_step_time([20, 80, 200], [0.06, 0.06, 0.06])
    assert fit.alpha == pytest.approx(0.0, abs=1e-12)
    assert fit.beta_s == pytest.approx(0.06)


def test_loo_needs_three_points():
    fit = fit_step_time([20, 80], [0.1, 0.16])
    assert fit.alpha == pytest.approx(1.0)
    assert fit.loo_rel_errors == [] and fit.loo_mean_rel_error is None


def test_loo_error_flags_an_outlier():
    rtts = [20, 40, 80, 120, 200]
    steps = [r / 1000 + 0.06 for r in rtts]
    steps[2] *= 1.5  # one bad point
    fit = fit_step_time(rtts, steps)
    assert fit.loo_rel_errors[2] > 0.2 and fit.loo_mean_rel_error > 0.1


def test_degenerate_inputs():
    with pytest.raises(ValueError):
        least_squares([1.0], [1.0])
    with pytest.raises(ValueError):
        least_squares([1.0, 1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        least_squares([1.0, 2.0], [1.0])
    d = fit_step_time([20, 40, 80], [0.08, 0.1, 0.14]).to_dict()
    assert {"alpha", "beta_s", "loo_mean_rel_error", "loo_max_rel_error", "rtts_ms", "steps_s"} <= d.keys()
