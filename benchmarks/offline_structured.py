"""Offline structured-output harness: tokens per round trip of constrained `auto` against unconstrained
`auto` stopped at the same length, on the bundled model in this process (no network, the fixed cost
curve of `offline_drafting.py`), so that grammar-aware drafting settings compare without the
machine's noise.

    .venv/bin/python benchmarks/offline_structured.py [--prompts FILE] [--limit N] [--steps]

Both runs use the same `auto` (with its copies of prompt text unless `--no-copy`). Constrained
greedy output is checked against constrained sequential decoding; each answer is validated against
its schema. `--steps` prints every round trip (accepted tokens, where it stopped).
Tune on benchmarks/prompts-json.json only; prompts-json-heldout.json is for the headline run.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import jsonschema
import torch
from offline_drafting import ROOT, FixedCostBudget, FixedCostSession, TimedDrafter, bundled, compute_s

from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.grammar import GrammarSpec, GrammarTokenizer, compile_grammar
from splitlm.decoding.grammar_decode import GrammarStats, constrained_decode, constrained_sequential
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.speculative import SpecStats, speculative_decode
from splitlm.edge.text import encode_prompt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=str(ROOT / "prompts-json.json"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--steps", action="store_true", help="print each round trip of the constrained run")
    ap.add_argument("--no-check", action="store_true", help="skip the sequential reference (faster)")
    ap.add_argument("--no-copy", action="store_true", help="auto without its copies of prompt text")
    args = ap.parse_args()
    torch.set_num_threads(1)
    run(args)


def run(args) -> None:
    model, tok, corpus, runner = bundled()
    # one memory each, the head's calibration included, as two edges would have
    memories = {name: DraftMemory.seeded(corpus, copy.deepcopy(runner)) for name in ("json", "free")}
    eos = set(model.cfg.eos_token_ids)
    gtok = GrammarTokenizer.from_hf(tok, model.cfg.vocab_size, model.cfg.eos_token_ids)
    text = None if args.no_copy else gtok.ll
    spec = SpecConfig(mode="auto")
    budgets = {name: FixedCostBudget(max_nodes=spec.budget_nodes, cost=spec.cost) for name in memories}
    prompts = json.loads(Path(args.prompts).read_text())[: args.limit]
    total = {"json": [0, 0, 0.0], "free": [0, 0, 0.0]}  # tokens, steps, modelled seconds
    valid = 0
    for p in prompts:
        ids = encode_prompt(tok, p["prompt"], p.get("chat", False))
        grammar = compile_grammar(GrammarSpec.json_schema(p["schema"]), gtok)
        stats, gstats = SpecStats(), GrammarStats()
        drafter = TimedDrafter(make_drafter(spec, memory=memories["json"], text=text))
        out: list[int] = []
        for new in constrained_decode(FixedCostSession(model), ids, args.max_new_tokens, eos, drafter,
                                      budgets["json"], stats, grammar.start(), gstats):
            if args.steps and out:
                print(f"    +{len(new):2d} {tok.decode(new)!r}")
            out += new
        answer = tok.decode([t for t in out if t not in eos])
        try:
            jsonschema.validate(json.loads(answer), p["schema"])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            print(f"  INVALID: {answer!r}")
        if not args.no_check:
            ref: list[int] = []
            for new in constrained_sequential(FixedCostSession(model), ids, args.max_new_tokens, eos,
                                              grammar.start(), GrammarStats()):
                ref += new
            assert out == ref, f"{p['id']}: constrained speculative output differs from sequential"
        free_stats = SpecStats()
        free: list[int] = []
        free_drafter = TimedDrafter(make_drafter(spec, memory=memories["free"], text=text))
        for new in speculative_decode(FixedCostSession(model), ids, len(out), eos, free_drafter, budgets["free"],
                                      free_stats):
            free += new
        for name, n, s, edge_s in (("json", len(out) - 1, stats, drafter.seconds + gstats.mask_s),
                                   ("free", len(free) - 1, free_stats, free_drafter.seconds)):
            t = total[name]
            t[0] += n
            t[1] += s.steps
            t[2] += edge_s + sum(FixedCostSession.rtt_s + compute_s(k) for k in s.choices)
        tj, tf = (len(out) - 1) / max(stats.steps, 1), (len(free) - 1) / max(free_stats.steps, 1)
        print(f"{p['id']:20s} json tau {tj:5.2f} ({len(out):3d} tok, forced {gstats.forced_tokens:3d}, "
              f"rejected {gstats.rejected_drafts:4d}, mask {1000 * gstats.mask_s / max(stats.steps, 1):4.1f} ms/step, "
              f"drafting {1000 * drafter.seconds / max(stats.steps, 1):4.1f} vs {1000 * free_drafter.seconds / max(free_stats.steps, 1):4.1f})"
              f"  free tau {tf:5.2f}  ratio {tj / tf:4.2f}", flush=True)
    tj, tf = total["json"][0] / total["json"][1], total["free"][0] / total["free"][1]
    rj, rf = total["json"][0] / total["json"][2], total["free"][0] / total["free"][2]
    print(f"ALL json tau {tj:.3f}  free tau {tf:.3f}  ratio {tj / tf:.3f}  modelled tok/s ratio {rj / rf:.3f}"
          f"  valid {valid}/{len(prompts)}")


if __name__ == "__main__":
    main()
