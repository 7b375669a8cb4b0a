"""The structured-output benchmark's summary (`splitlm bench --prompts benchmarks/prompts-json.json
--modes auto+json,auto-json-length,auto,none+json`): constrained `auto` against unconstrained `auto`
and constrained sequential decoding, at each RTT, on the same prompts in one run. Unconstrained
`auto` is compared twice: left to run to the token limit, and stopped at the length of the
constrained answer to the same prompt (`auto-json-length`), so that both decode as many tokens.

Per mode: tokens per round trip, tok/s, the share of answers valid against their prompt's schema,
the forced tokens, the rejected drafts and the mask's cost per computed mask. Then the issue's
targets: constrained `auto` τ ≥ 1.3 × unconstrained `auto`, its tok/s ≥ unconstrained `auto`'s,
every constrained answer valid, and constrained `auto` token-identical to constrained sequential;
the two ratios are also given, and checked (`..._same_length`), against the length-matched `auto`:
the reading the project counts (docs/decisions.md, "Constrained decoding").
"""

from __future__ import annotations

CONSTRAINED, FREE, FREE_SAME_LENGTH, SEQUENTIAL = "auto+json", "auto", "auto-json-length", "none+json"
FIELDS = (
    "tokens_per_round_trip",
    "tok_s",
    "schema_valid",
    "forced_tokens",
    "rejected_drafts",
    "mask_us_per_step",
    "new_tokens",
    "round_trips",
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def at_least(ratio: float | None, target: float) -> bool:
    return ratio is not None and ratio >= target


def identical(runs: list[dict], rtt: float) -> float | None:
    """The share of prompts whose constrained `auto` ids equal constrained sequential's at `rtt`."""
    seq = {r["prompt_id"]: r["token_ids"] for r in runs if r["mode"] == SEQUENTIAL and r["rtt_ms"] == rtt}
    pairs = [
        (r["token_ids"], seq[r["prompt_id"]])
        for r in runs
        if r["mode"] == CONSTRAINED and r["rtt_ms"] == rtt and r["prompt_id"] in seq
    ]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def structured_summary(doc: dict) -> dict:
    """The section of a bench document (empty without the constrained `auto` mode)."""
    overall = {(r["mode"], r["rtt_ms"]): r for r in doc["results"] if r["category"] == "all"}
    rtts = sorted({rtt for mode, rtt in overall if mode == CONSTRAINED})
    rows = []
    for rtt in rtts:
        modes = {
            m: {k: overall[m, rtt].get(k) for k in FIELDS}
            for m in (CONSTRAINED, FREE, FREE_SAME_LENGTH, SEQUENTIAL)
            if (m, rtt) in overall
        }
        c, f, fl = modes[CONSTRAINED], modes.get(FREE, {}), modes.get(FREE_SAME_LENGTH, {})
        tau_ratio = _ratio(c["tokens_per_round_trip"], f.get("tokens_per_round_trip"))
        tok_s_ratio = _ratio(c["tok_s"], f.get("tok_s"))
        same_length = (
            {
                "tau": _ratio(c["tokens_per_round_trip"], fl.get("tokens_per_round_trip")),
                "tok_s": _ratio(c["tok_s"], fl.get("tok_s")),
            }
            if fl
            else None
        )
        same = identical(doc["runs"], rtt)
        valid = [modes[m]["schema_valid"] for m in (CONSTRAINED, SEQUENTIAL) if m in modes]
        rows.append(
            {
                "rtt_ms": rtt,
                "modes": modes,
                "tau_vs_auto": tau_ratio,
                "tok_s_vs_auto": tok_s_ratio,
                "vs_auto_same_length": same_length,
                "identical_to_sequential": same,
                "targets": {
                    "tau_at_least_1.3x": at_least(tau_ratio, 1.3),
                    "tok_s_at_least_auto": at_least(tok_s_ratio, 1.0),
                    **(
                        {
                            "tau_at_least_1.3x_same_length": at_least(same_length["tau"], 1.3),
                            "tok_s_at_least_auto_same_length": at_least(same_length["tok_s"], 1.0),
                        }
                        if same_length
                        else {}
                    ),
                    "all_valid": all(v == 1.0 for v in valid),
                    "identical_to_sequential": same in (None, 1.0),
                },
            }
        )
    return {"rtts": rows} if rows else {}


def _fmt(v, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def markdown(section: dict) -> str:
    """The summary as a Markdown section."""
    if not section:
        return ""
    lines = ["## Structured outputs (JSON schemas)", ""]
    for row in section["rtts"]:
        lines += [
            f"RTT {row['rtt_ms']:g} ms: constrained auto τ × auto {_fmt(row['tau_vs_auto'])}, tok/s × auto "
            f"{_fmt(row['tok_s_vs_auto'])}, identical to constrained sequential "
            f"{_fmt(row['identical_to_sequential'], '.0%')}; targets: "
            + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in row["targets"].items()),
            "",
            *(
                [
                    f"Against unconstrained auto stopped at the constrained answer's length (auto-json-length): "
                    f"τ × {_fmt(row['vs_auto_same_length']['tau'])}, tok/s × "
                    f"{_fmt(row['vs_auto_same_length']['tok_s'])}",
                    "",
                ]
                if row.get("vs_auto_same_length")
                else []
            ),
            "| mode | tok/RT | tok/s | valid | forced | rejected drafts | mask µs |",
            "|---|---|---|---|---|---|---|",
        ]
        for m, r in row["modes"].items():
            lines.append(
                f"| {m} | {_fmt(r['tokens_per_round_trip'])} | {_fmt(r['tok_s'], '.1f')} | "
                f"{_fmt(r['schema_valid'], '.0%')} | {r['forced_tokens']} | {r['rejected_drafts']} | "
                f"{_fmt(r['mask_us_per_step'], '.0f')} |"
            )
        lines.append("")
    return "\n".join(lines)
