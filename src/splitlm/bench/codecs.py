"""Codec study: for each wire codec, bytes per token and agreement with the full model's greedy tokens.

Runs directly against the bench's cloud (no emulated delay: bytes and agreement do not depend on
the RTT). Per codec and prompt: teacher-forced next-token agreement (the reference continuation fed
in one pass; the seed paper's metric), free-running greedy agreement (position by position, until
the first difference, the usual way split systems drift), and decoding bytes per token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from splitlm.bench.modes import BenchContext, run_edge, teacher_forced_agreement
from splitlm.decoding.modes import SpecConfig

log = logging.getLogger(__name__)


def codec_rows(
    make_context: Callable[[str], BenchContext],
    prompts: list,
    reference: dict[str, list[int]],
    codecs: list[str],
    max_new_tokens: int,
) -> list[dict]:
    """`make_context(codec)`: a bench context whose edge reaches the cloud with that wire codec."""
    rows = []
    for codec in codecs:
        ctx = make_context(codec)
        hits = positions = exact = prefix = generated = up = down = decode_tokens = 0
        try:
            for p in prompts:
                ref = reference[p.id]
                h, n = teacher_forced_agreement(ctx, p.ids, ref)
                hits, positions = hits + h, positions + n
                run = run_edge(ctx, p.ids, max_new_tokens, SpecConfig("none"))
                ids = run.token_ids
                exact += int(ids == ref)
                prefix += next(
                    (i for i, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b), min(len(ids), len(ref))
                )
                generated += len(ref)
                up += run.bytes_up
                down += run.bytes_down
                decode_tokens += len(ids) - run.first_tokens
        finally:
            ctx.close()
        row = {
            "codec": codec,
            "prompts": len(prompts),
            "teacher_forced_agreement": round(hits / positions, 4) if positions else None,
            "greedy_prefix_agreement": round(prefix / generated, 4) if generated else None,
            "exact_match": round(exact / len(prompts), 4) if prompts else None,
            "bytes_up_per_token": round(up / decode_tokens, 1) if decode_tokens else None,
            "bytes_down_per_token": round(down / decode_tokens, 1) if decode_tokens else None,
        }
        log.info(
            f"[bench] codec {codec:<5} agreement {row['teacher_forced_agreement']}  greedy prefix "
            f"{row['greedy_prefix_agreement']}  B/tok up {row['bytes_up_per_token']} down {row['bytes_down_per_token']}"
        )
        rows.append(row)
    return rows


def codec_table(rows: list[dict]) -> list[str]:
    def pct(v):
        return "" if v is None else f"{100 * v:.1f} %"

    lines = [
        "| codec | B up/tok | B down/tok | teacher-forced agreement | greedy prefix agreement | exact |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['codec']} | {r['bytes_up_per_token']:.0f} | {r['bytes_down_per_token']:.0f} | "
            f"{pct(r['teacher_forced_agreement'])} | {pct(r['greedy_prefix_agreement'])} | "
            f"{pct(r['exact_match'])} |"
        )
    return lines
