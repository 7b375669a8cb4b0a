"""Benchmark figures: one row per (mode, RTT, prompt), pooled into rows per category and overall.

Definitions (see DESIGN.md, "Measuring"):
- decoding = everything after the prefill step (whose first token gives the TTFT).
- tokens_per_round_trip = decoding tokens / decoding round trips (sequential split = 1.0;
  None for modes that never touch the network).
- tok_s = decoding tokens / decoding seconds; step_s = decoding seconds / decoding steps,
  split into network / cloud compute / edge compute / serialisation / other (the remainder:
  Python, websockets and the event loop).
- bytes_*_per_token: bytes on the wire while decoding / decoding tokens (prefill bytes, which
  grow with the prompt, are reported apart).
- agreement: teacher-forced next-token agreement with the full `transformers` model;
  exact_match: the generated ids equal the full model's greedy ids.
- bound_tok_s = tokens_per_round_trip / (RTT + measured compute per step): what a stack with
  no overhead of its own would reach; efficiency = tok_s / bound_tok_s.
- tok_s_vs_split_seq: tok_s / split-seq's tok_s at the same RTT and category, in the same run.
- pipelined_fraction: decoding round trips sent while another was in flight / decoding round trips;
  discarded_fraction: of those, the ones whose reply was dropped; missed_fraction: dropped because
  the bet failed (the rest held but guessed none of the bonus token's candidates).
Pooled rows sum numerators and denominators over prompts (time-weighted), except TTFT (mean).
"""

from __future__ import annotations

from splitlm.bench.modes import MODES, ModeRun
from splitlm.bench.prompts import Prompt
from splitlm.bench.stepmodel import fit_step_time
from splitlm.decoding.request import GrammarStats

BASELINE_MODE = "split-seq"
PREDICT_RTTS_MS = (0, 10, 20, 50, 80, 100, 150, 200, 300, 500)


def prompt_row(
    mode: str,
    rtt_ms: float,
    prompt: Prompt,
    run: ModeRun,
    reference: list[int],
    agreement: tuple[int, int],
    text: str = "",
) -> dict:
    """The figures of one prompt through one mode at one RTT."""
    decode_tokens = max(0, len(run.token_ids) - run.first_tokens)
    steps = run.steps
    network = MODES[mode].network
    return {
        "mode": mode,
        "rtt_ms": rtt_ms,
        "prompt_id": prompt.id,
        "category": prompt.category,
        "prompt_tokens": len(prompt.ids),
        "new_tokens": len(run.token_ids),
        "decode_tokens": decode_tokens,
        "steps": steps,
        "round_trips": run.round_trips,
        "tokens_per_round_trip": (decode_tokens / run.round_trips if run.round_trips else None) if network else None,
        "ttft_s": run.ttft_s,
        "decode_s": run.decode_s,
        "tok_s": decode_tokens / run.decode_s if run.decode_s > 0 else None,
        "step_s": run.decode_s / steps if steps else None,
        "network_s": run.network_s,
        "cloud_s": run.cloud_s,
        "edge_s": run.edge_s,
        "serialize_s": run.serialize_s,
        "bytes_up": run.bytes_up,
        "bytes_down": run.bytes_down,
        "prefill_bytes_up": run.prefill_bytes_up,
        "prefill_bytes_down": run.prefill_bytes_down,
        "pipelined_steps": run.pipelined,
        "discarded_steps": run.discarded,
        "missed_bets": run.missed,
        "spec_steps": run.spec_steps,
        "tree_nodes": run.tree_nodes,
        "window_tokens": run.window_tokens,
        "exact_match": run.token_ids == reference,
        "schema_valid": schema_valid(prompt.schema, text),
        **grammar_fields(run.grammar),
        "agreement_matches": agreement[0],
        "agreement_positions": agreement[1],
        "token_ids": run.token_ids,
        "text": text,
    }


def schema_valid(schema: dict | None, text: str) -> bool | None:
    """Whether `text` is JSON valid against `schema` (None: the prompt has no schema)."""
    if schema is None:
        return None
    import json

    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def grammar_fields(g: GrammarStats | None) -> dict:
    """A constrained run's grammar figures (zero for an unconstrained run)."""
    g = g or GrammarStats()
    return {
        "forced_tokens": g.forced_tokens,
        "rejected_drafts": g.rejected_drafts,
        "mask_steps": g.mask_steps,
        "mask_s": g.mask_s,
    }


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def pool(rows: list[dict], memory: dict | None = None) -> dict:
    """Pool per-prompt rows of one mode at one RTT into one row."""
    first = rows[0]
    s = {
        k: sum(r[k] for r in rows)
        for k in (
            "decode_tokens",
            "steps",
            "round_trips",
            "decode_s",
            "network_s",
            "cloud_s",
            "edge_s",
            "serialize_s",
            "bytes_up",
            "bytes_down",
            "agreement_matches",
            "agreement_positions",
            "new_tokens",
        )
    }
    network = MODES[first["mode"]].network
    step = _ratio(s["decode_s"], s["steps"])
    parts = {k: _ratio(s[k], s["steps"]) for k in ("network_s", "cloud_s", "edge_s", "serialize_s")}
    tau = _ratio(s["decode_tokens"], s["round_trips"]) if network else None
    tok_s = _ratio(s["decode_tokens"], s["decode_s"])
    bound = efficiency = None
    if network and tau and step is not None:
        compute = (parts["cloud_s"] or 0) + (parts["edge_s"] or 0)
        bound = tau / (first["rtt_ms"] / 1000 + compute)
        efficiency = tok_s / bound if tok_s else None
    mem = (memory or {}).get(first["mode"], {})
    return {
        "mode": first["mode"],
        "rtt_ms": first["rtt_ms"],
        "prompts": len(rows),
        "new_tokens": s["new_tokens"],
        "decode_tokens": s["decode_tokens"],
        "round_trips": s["round_trips"],
        "tokens_per_round_trip": tau,
        "tok_s": tok_s,
        "tokens_per_step": _ratio(s["decode_tokens"], s["steps"]),  # per forward pass for local modes
        "ttft_s": sum(r["ttft_s"] for r in rows) / len(rows),
        "step_s": step,
        "network_s_per_step": parts["network_s"],
        "cloud_s_per_step": parts["cloud_s"],
        "edge_s_per_step": parts["edge_s"],
        "serialize_s_per_step": parts["serialize_s"],
        "other_s_per_step": None if step is None else step - sum(v or 0 for v in parts.values()),
        "bytes_up_per_token": _ratio(s["bytes_up"], s["decode_tokens"]),
        "bytes_down_per_token": _ratio(s["bytes_down"], s["decode_tokens"]),
        "prefill_bytes_up": sum(r["prefill_bytes_up"] for r in rows) / len(rows),
        "agreement": _ratio(s["agreement_matches"], s["agreement_positions"]),
        "exact_match": sum(r["exact_match"] for r in rows) / len(rows),
        "bound_tok_s": bound,
        "efficiency": efficiency,
        "edge_peak_rss_mb": mem.get("peak_rss_mb"),
        # pipelined mode: the share of decoding round trips sent while another was in flight, and of those
        # the share whose reply was dropped (the bet on the step before failed)
        "pipelined_fraction": _ratio(sum(r.get("pipelined_steps", 0) for r in rows), s["round_trips"]),
        "discarded_fraction": _ratio(
            sum(r.get("discarded_steps", 0) for r in rows), sum(r.get("pipelined_steps", 0) for r in rows)
        ),
        "missed_fraction": _ratio(
            sum(r.get("missed_bets", 0) for r in rows), sum(r.get("pipelined_steps", 0) for r in rows)
        ),
        # speculative modes: what the budget chose to send per verification step
        "mean_tree_nodes": _ratio(sum(r.get("tree_nodes", 0) for r in rows), sum(r.get("spec_steps", 0) for r in rows)),
        "mean_window_tokens": _ratio(
            sum(r.get("window_tokens", 0) for r in rows), sum(r.get("spec_steps", 0) for r in rows)
        ),
        # prompts with a JSON schema: the share of answers valid against it; constrained modes: the grammar's work
        "schema_valid": _ratio(
            sum(bool(r.get("schema_valid")) for r in rows), sum(r.get("schema_valid") is not None for r in rows)
        ),
        "forced_tokens": sum(r.get("forced_tokens", 0) for r in rows),
        "rejected_drafts": sum(r.get("rejected_drafts", 0) for r in rows),
        "mask_us_per_step": _ratio(
            1e6 * sum(r.get("mask_s", 0.0) for r in rows), sum(r.get("mask_steps", 0) for r in rows)
        ),
    }


def aggregate(rows: list[dict], memory: dict | None = None) -> list[dict]:
    """Rows per (mode, RTT): overall (category "all") first, then one per category."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["rtt_ms"]), []).append(r)
    for (_, _), group in groups.items():
        out.append({"category": "all", **pool(group, memory)})
        categories: dict[str, list[dict]] = {}
        for r in group:
            categories.setdefault(r["category"], []).append(r)
        for cat, cat_rows in categories.items():
            out.append({"category": cat, **pool(cat_rows, memory)})
    baseline = {(r["rtt_ms"], r["category"]): r["tok_s"] for r in out if r["mode"] == BASELINE_MODE}
    for r in out:  # the ratio that stays meaningful on a noisy machine: measured in the same run
        base = baseline.get((r["rtt_ms"], r["category"]))
        r["tok_s_vs_split_seq"] = r["tok_s"] / base if base and r["tok_s"] else None
    return out


def fit_sweep(results: list[dict], predict_rtts: tuple = PREDICT_RTTS_MS) -> dict:
    """Fit t_step = α·RTT + β per mode over the overall rows of an RTT sweep."""
    fits = {}
    modes = dict.fromkeys(r["mode"] for r in results)
    for mode in modes:
        points = [r for r in results if r["mode"] == mode and r["category"] == "all" and r["step_s"]]
        if len({p["rtt_ms"] for p in points}) < 2:
            continue
        fit = fit_step_time([p["rtt_ms"] for p in points], [p["step_s"] for p in points])
        # tokens per step: per round trip for network modes, 1 for local ones
        tau_num = sum(p["decode_tokens"] for p in points)
        tau = tau_num / sum(p["round_trips"] for p in points) if MODES[mode].network else 1.0
        rtts = sorted({*predict_rtts, *(p["rtt_ms"] for p in points)})
        fits[mode] = {
            **fit.to_dict(),
            "tokens_per_step": tau,
            "measured_tok_s": [p["tok_s"] for p in points],
            "predictions": [{"rtt_ms": r, "step_s": fit.step_s(r), "tok_s": fit.tok_s(r, tau)} for r in rtts],
        }
    return fits
