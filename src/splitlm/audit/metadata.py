"""Metadata: what the cloud learns from the shape of the traffic alone (no activations).

Per request it sees the prompt's length (the prefill's rows), the number of steps, every step's
rows and visibility mask (the draft tree's shape) and, with the next request, the keep list (how
many drafts were accepted). From these it can count the generated tokens and tell how predictable
the text is; `classify` measures how well that separates code from prose. Fixed tree shapes
(padding every step to the same rows) are simulated, not built: the keep lists and the number of
steps still show."""

from __future__ import annotations

import statistics

import torch

from splitlm.audit.traces import Trace

SHAPE_FEATURES = ["steps", "mean_rows", "max_rows", "mean_accepted", "accept_rate"]
KEEP_FEATURES = ["steps", "mean_accepted", "accept_rate"]  # what fixed tree shapes leave visible
PROMPT_FEATURES = ["prompt_tokens"]


def features(trace: Trace) -> dict[str, float]:
    steps = trace.steps[1:]
    rows = [len(s.ids) for s in steps] or [0]
    accepted = [len(s.keep) - 1 for s in steps[:-1] if s.keep is not None] or [0]  # the last keep is never sent
    return {
        "prompt_tokens": len(trace.steps[0].ids),
        "steps": len(steps),
        "mean_rows": statistics.mean(rows),
        "max_rows": max(rows),
        "mean_accepted": statistics.mean(accepted),
        "accept_rate": sum(a > 0 for a in accepted) / len(accepted),
    }


def known_count(trace: Trace) -> int:
    """Generated tokens the cloud can count for sure: the prefill's, every sent keep list's, and at
    least one from the last step."""
    return 1 + sum(len(s.keep) for s in trace.steps[1:-1] if s.keep is not None) + (len(trace.steps) > 1)


def classify(traces: list[Trace], names: list[str]) -> float:
    """Leave-one-out accuracy of a nearest-centroid classifier (standardised features) of the labels."""
    x = torch.tensor([[features(t)[n] for n in names] for t in traces], dtype=torch.float64)
    labels = [t.label for t in traces]
    right = 0
    for i in range(len(traces)):
        rest = [j for j in range(len(traces)) if j != i]
        mu, sd = x[rest].mean(0), x[rest].std(0, correction=0).clamp_min(1e-9)
        z = (x - mu) / sd
        best = min(
            set(labels[j] for j in rest),
            key=lambda lab: float((z[i] - z[[j for j in rest if labels[j] == lab]].mean(0)).norm()),
        )
        right += best == labels[i]
    return right / len(traces)


def metadata_audit(traces: list[Trace], estimated_counts: list[int] | None = None, cap: int | None = None) -> dict:
    """The counting, the classifiers, and the cost of padding every step to the largest tree.
    `estimated_counts`: the cloud's own counts; `cap`: the generations' length limit (a cloud that
    knows it, e.g. a client's default, cuts its count there)."""
    truth = [len(t.generated) for t in traces]
    known = [known_count(t) for t in traces]
    rows = [len(s.ids) for t in traces for s in t.steps[1:]]
    out = {
        "generations": len(traces),
        "labels": sorted(set(t.label for t in traces)),
        "count_exact_known": sum(a == b for a, b in zip(known, truth, strict=True)) / len(traces),
        "count_mean_abs_error_known": statistics.mean(abs(a - b) for a, b in zip(known, truth, strict=True)),
        "classify_shape": classify(traces, SHAPE_FEATURES),
        "classify_keep_only": classify(traces, KEEP_FEATURES),
        "classify_prompt_length": classify(traces, PROMPT_FEATURES),
        "mean_rows_per_step": statistics.mean(rows) if rows else 0.0,
        "max_rows_per_step": max(rows, default=0),
        "fixed_shape_row_overhead": (max(rows) * len(rows) / sum(rows) - 1) if rows else 0.0,
        "per_label": {
            lab: {
                n: statistics.mean(features(t)[n] for t in traces if t.label == lab)
                for n in PROMPT_FEATURES + SHAPE_FEATURES
            }
            for lab in sorted(set(t.label for t in traces))
        },
    }
    if estimated_counts is not None:
        out["count_exact_estimated"] = sum(a == b for a, b in zip(estimated_counts, truth, strict=True)) / len(traces)
        if cap is not None:
            out["count_exact_estimated_capped"] = sum(
                min(a, cap) == b for a, b in zip(estimated_counts, truth, strict=True)
            ) / len(traces)
    return out
