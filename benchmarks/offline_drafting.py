"""Offline drafting harness: tokens per round trip of a speculative mode on the bundled model, the
whole model in this process (no network, no cloud), with a fixed cost curve instead of measured
step times, so that two drafter settings can be compared without the machine's noise.

    .venv/bin/python benchmarks/offline_drafting.py --mode auto [--prompts FILE] [--limit N]

Prints τ per category, the mean tree size, the drafting time per step (measured: propose + learn)
and the tok/s the cost curve predicts (RTT + compute(T) + drafting, per step). Greedy output is
checked against sequential decoding of the same model. Needs the bundled model's split (any
`splitlm bench` or `splitlm split` run makes it) and, for `auto`/`head`, its trained draft head.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.corpus import default_corpus_documents
from splitlm.decoding.grammar import GrammarTokenizer
from splitlm.decoding.head import HeadRunner, load_head, read_head
from splitlm.decoding.layer_drafter import LayerHeadRunner
from splitlm.decoding.layer_head import LayerHead
from splitlm.decoding.local import LocalSession
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.step import StepInput, StepResult
from splitlm.decoding.suffix import SuffixIndex
from splitlm.decoding.warmup import find_warmup, read_warmup
from splitlm.edge.text import encode_prompt
from splitlm.model.loading import file_sha256, load_model, safetensors_files
from splitlm.model.shards import cached_split

ROOT = Path(__file__).resolve().parent
LAYERS = (2, 28)  # the bundled model split K = 2, M = 2: the layers a head that reads the edge's layers reads


def compute_s(tokens: int) -> float:
    """Edge + cloud compute of a T-token pass, shaped like the Intel Xeon's blocked layers (bench
    2026-12-02 03:07: 122 ms at 1 token, about 167 at 13); fixed, so runs compare on any machine."""
    return 0.122 + 0.0045 * min(tokens - 1, 8) + 0.0025 * max(tokens - 9, 0)


class FixedCostSession(LocalSession):
    rtt_s = 0.09

    def forward(self, request: StepInput) -> StepResult:
        step = super().forward(request)
        step.network_s, step.compute_s = self.rtt_s, compute_s(len(request.ids))
        return step


class FixedCostBudget(StepBudget):
    """The budget with a fixed per-step edge overhead instead of the measured one (drafting and mask
    times vary with the machine's load), so that a run repeats to the token."""

    overhead_s = 0.02

    def observe_step(
        self, tokens: int, compute_s: float, network_s: float, overhead_s: float = 0.0, edge_s: float = 0.0
    ) -> None:
        super().observe_step(tokens, compute_s, network_s, FixedCostBudget.overhead_s, edge_s)


class TimedDrafter:
    """Wraps a drafter and adds up the seconds spent drafting and learning."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("propose", "propose_after", "verified", "accepted", "extend", "reset"):
            return attr

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--cost", default="measured")
    # tune on prompts.json and prompts-tuning.json; never on prompts-headline.json (frozen) or Spec-Bench
    ap.add_argument("--prompts", default=str(ROOT / "prompts.json"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--no-copy", action="store_true", help="auto without its copies of prompt text")
    ap.add_argument("--head", default=None, help="a draft head file (default: the split's, as the edge finds it)")
    ap.add_argument("--profile", action="store_true", help="print where drafting spends its time (cProfile)")
    args = ap.parse_args()
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(run, args)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(
            r"decoding/(auto|head|recycle|suffix|tree|drafters|budget)", 40
        )
    else:
        run(args)


def bundled(head_file: str | None = None):
    """The bundled model, its tokenizer, the warm-up corpus's suffix index and the draft head's runner
    (None without a trained head): what the edge's `auto` drafts with."""
    model, model_dir = load_model("default")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    edge_dir = cached_split("default", 2, 2, "tail-local", None) / "edge"
    model_hash = file_sha256(safetensors_files(model_dir))[:32]
    docs = default_corpus_documents()
    if (w := find_warmup(edge_dir, model_hash)) is not None:
        docs += read_warmup(w)
    head = read_head(head_file) if head_file else load_head(edge_dir, model_hash, LAYERS)
    kind = LayerHeadRunner if isinstance(head, LayerHead) else HeadRunner
    runner = None if head is None else kind(head, model.embed_tokens.weight, model.embed_tokens.weight)
    return model, tok, SuffixIndex(tok(docs, add_special_tokens=False).input_ids), runner


def run(args) -> None:
    torch.set_num_threads(1)
    model, tok, corpus, runner = bundled(args.head)
    memory = DraftMemory.seeded(corpus, runner)
    text = None if args.no_copy else GrammarTokenizer.from_hf(tok, model.cfg.vocab_size, model.cfg.eos_token_ids).ll
    spec = SpecConfig(mode=args.mode, cost=args.cost)
    budget = FixedCostBudget(max_nodes=spec.budget_nodes, cost=spec.cost)
    prompts = json.loads(Path(args.prompts).read_text())[: args.limit]
    eos = set(model.cfg.eos_token_ids)
    by_cat: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0, 0])  # tokens, steps, draft s, step s, nodes
    for p in prompts:
        ids = encode_prompt(tok, p["prompt"], p.get("chat", False))
        drafter = TimedDrafter(make_drafter(spec, memory=memory, text=text))
        stats = SpecStats()
        out = []
        for new in decode(
            FixedCostSession(model, LAYERS),
            DecodeRequest(ids, args.max_new_tokens, eos, speculation=Speculation(drafter, budget, stats)),
        ):
            out += new
        ref = []
        for new in decode(
            FixedCostSession(model, LAYERS),
            DecodeRequest(
                ids,
                args.max_new_tokens,
                eos,
                speculation=Speculation(make_drafter(SpecConfig()), StepBudget(), SpecStats()),
            ),
        ):
            ref += new
        assert out == ref, f"{p['id']}: speculative output differs from sequential"
        c = by_cat[p["category"]]
        c[0] += len(out) - 1
        c[1] += stats.steps
        c[2] += drafter.seconds
        c[3] += sum(FixedCostSession.rtt_s + compute_s(n) for n in stats.choices)
        c[4] += stats.tree_nodes
        print(
            f"{p['id']:36s} tau {(len(out) - 1) / max(stats.steps, 1):.2f}  nodes "
            f"{stats.tree_nodes / max(stats.steps, 1):5.1f}"
            f"  draft {1000 * drafter.seconds / max(stats.steps, 1):5.1f} ms/step",
            flush=True,
        )
    total = [sum(c[i] for c in by_cat.values()) for i in range(5)]
    seq_rate = 1.0 / (FixedCostSession.rtt_s + compute_s(1))
    for name, c in sorted(by_cat.items()) + [("ALL", total)]:
        rate = c[0] / (c[3] + c[2])
        print(
            f"{name:16s} tau {c[0] / c[1]:.3f}  nodes {c[4] / c[1]:5.1f}  draft {1000 * c[2] / c[1]:5.1f} ms/step"
            f"  predicted x seq {rate / seq_rate:.3f}"
        )


if __name__ == "__main__":
    main()
