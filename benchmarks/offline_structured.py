"""Offline structured-output harness: tokens per round trip of constrained `auto` against unconstrained
`auto` stopped at the same length, on the bundled model in this process (no network, the fixed cost
curve of `offline_drafting.py`), so that grammar-aware drafting settings compare without the
machine's noise.

    .venv/bin/python benchmarks/offline_structured.py [--prompts FILE] [--limit N] [--steps] [--cost zero]

Both runs use the same `auto` (with its copies of prompt text unless `--no-copy`). A third run,
"same text", is unconstrained `auto` scripted to write the constrained answer itself
(`ScriptedSession`: the model's own passes, each row's greedy token replaced by the answer's next
token where the row's path is the answer's): the grammar's gain on one and the same token stream,
where the free run's text is this small model's own (often pretty-printed, often a repetition loop). Constrained
greedy output is checked against constrained sequential decoding; each answer is validated against
its schema. `--steps` prints every round trip (accepted tokens, where it stopped).
Tune on benchmarks/prompts-json.json only; prompts-json-heldout.json is for the headline run.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import torch
from offline_drafting import ROOT, FixedCostBudget, FixedCostSession, TimedDrafter, bundled, compute_s

from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.grammar import GrammarSpec, GrammarTokenizer, compile_grammar
from splitlm.decoding.grammar_decode import GrammarStats
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.step import StepInput, StepResult
from splitlm.edge.text import encode_prompt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=str(ROOT / "prompts-json.json"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--steps", action="store_true", help="print each round trip of the constrained run")
    ap.add_argument("--no-check", action="store_true", help="skip the sequential reference (faster)")
    ap.add_argument("--no-copy", action="store_true", help="auto without its copies of prompt text")
    ap.add_argument(
        "--cost",
        default="measured",
        choices=("measured", "zero"),
        help="the budget's cost model (zero: a GPU cloud's, extra nodes free)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    run(args)


class ScriptedSession(FixedCostSession):
    """The model's passes, but a row whose path follows `target` (prompt and answer) picks the
    target's next token: speculative decoding then writes `target` whatever the model prefers, and
    its drafters see the model's own hidden states and top-k."""

    def __init__(self, model, target: list[int], end: int):
        super().__init__(model)
        self.target, self.end = target, end

    def forward(self, request: StepInput) -> StepResult:
        ids, positions, mask, rows = request.ids, request.positions, request.mask, request.rows
        if positions is None:  # the prefill: the tokens follow the cache
            positions = list(range(self.length, self.length + len(ids)))
        step = super().forward(replace(request, positions=positions))
        on = []
        for i, (tok, pos) in enumerate(zip(ids, positions, strict=True)):
            parents = range(i) if mask is None else [j for j in range(i) if mask[i, j]]
            ok = pos < len(self.target) and self.target[pos] == tok and all(on[j] for j in parents)
            on.append(ok)
        step.out = step.out.clone()  # an inference tensor: not writable outside inference mode
        for r, i in enumerate(rows if rows is not None else range(len(ids))):
            if on[i]:
                nxt = self.target[positions[i] + 1] if positions[i] + 1 < len(self.target) else self.end
                if step.out.dim() == 1:
                    step.out[r] = nxt
                else:
                    step.out[r, nxt] = step.out[r].max() + 1.0
        return step


def run(args) -> None:
    model, tok, corpus, runner = bundled()
    # one memory each, the head's calibration included, as two edges would have
    memories = {name: DraftMemory.seeded(corpus, copy.deepcopy(runner)) for name in ("json", "free", "same")}
    eos = set(model.cfg.eos_token_ids)
    gtok = GrammarTokenizer.from_hf(tok, model.cfg.vocab_size, model.cfg.eos_token_ids)
    text = None if args.no_copy else gtok.ll
    spec = SpecConfig(mode="auto", cost=args.cost)
    budgets = {name: FixedCostBudget(max_nodes=spec.budget_nodes, cost=spec.cost) for name in memories}
    prompts = json.loads(Path(args.prompts).read_text())[: args.limit]
    total = {name: [0, 0, 0.0, 0] for name in memories}  # tokens, steps, modelled seconds, nodes sent
    valid = 0
    for p in prompts:
        ids = encode_prompt(tok, p["prompt"], p.get("chat", False))
        grammar = compile_grammar(GrammarSpec.json_schema(p["schema"]), gtok)
        stats, gstats = SpecStats(), GrammarStats()
        drafter = TimedDrafter(make_drafter(spec, memory=memories["json"], text=text))
        out: list[int] = []
        for new in decode(
            FixedCostSession(model),
            DecodeRequest(
                ids,
                args.max_new_tokens,
                eos,
                grammar=grammar.start(),
                grammar_stats=gstats,
                speculation=Speculation(drafter, budgets["json"], stats),
            ),
        ):
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
            for new in decode(
                FixedCostSession(model),
                DecodeRequest(ids, args.max_new_tokens, eos, grammar=grammar.start(), grammar_stats=GrammarStats()),
            ):
                ref += new
            assert out == ref, f"{p['id']}: constrained speculative output differs from sequential"
        free_stats = SpecStats()
        free: list[int] = []
        free_drafter = TimedDrafter(make_drafter(spec, memory=memories["free"], text=text))
        for new in decode(
            FixedCostSession(model),
            DecodeRequest(ids, len(out), eos, speculation=Speculation(free_drafter, budgets["free"], free_stats)),
        ):
            free += new
        same_stats = SpecStats()
        same: list[int] = []
        same_drafter = TimedDrafter(make_drafter(spec, memory=memories["same"], text=text))
        for new in decode(
            ScriptedSession(model, ids + out, min(eos)),
            DecodeRequest(ids, len(out), eos, speculation=Speculation(same_drafter, budgets["same"], same_stats)),
        ):
            same += new
        assert same == out, f"{p['id']}: the scripted run did not write the constrained answer"
        for name, n, s, edge_s in (
            ("json", len(out) - 1, stats, drafter.seconds + gstats.mask_s),
            ("free", len(free) - 1, free_stats, free_drafter.seconds),
            ("same", len(same) - 1, same_stats, same_drafter.seconds),
        ):
            t = total[name]
            t[0] += n
            t[1] += s.steps
            t[2] += edge_s + sum(FixedCostSession.rtt_s + compute_s(k) for k in s.choices)
            t[3] += sum(s.choices)
        tj, tf = (len(out) - 1) / max(stats.steps, 1), (len(free) - 1) / max(free_stats.steps, 1)
        ts = (len(same) - 1) / max(same_stats.steps, 1)
        print(
            f"{p['id']:20s} json tau {tj:5.2f} ({len(out):3d} tok, forced {gstats.forced_tokens:3d}, "
            f"rejected {gstats.rejected_drafts:4d}, mask {1000 * gstats.mask_s / max(stats.steps, 1):4.1f} ms/step, "
            f"drafting {1000 * drafter.seconds / max(stats.steps, 1):4.1f} vs "
            f"{1000 * free_drafter.seconds / max(free_stats.steps, 1):4.1f})"
            f"  free tau {tf:5.2f}  ratio {tj / tf:4.2f}  same text {ts:5.2f} ratio {tj / ts:4.2f}",
            flush=True,
        )
    tj, tf, ts = (total[name][0] / total[name][1] for name in ("json", "free", "same"))
    rj, rf, rs = (total[name][0] / total[name][2] for name in ("json", "free", "same"))
    print(
        f"ALL json tau {tj:.3f}  free tau {tf:.3f}  ratio {tj / tf:.3f}  modelled tok/s ratio {rj / rf:.3f}"
        f"  same text tau {ts:.3f}  ratio {tj / ts:.3f}  tok/s ratio {rj / rs:.3f}"
        f"  nodes {total['json'][3] / total['json'][1]:.1f} vs {total['free'][3] / total['free'][1]:.1f}"
        f"  valid {valid}/{len(prompts)}"
    )


if __name__ == "__main__":
    main()
