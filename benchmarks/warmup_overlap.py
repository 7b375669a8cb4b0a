"""Near-twins between the benchmark prompt sets and the bundled warm-up requests (`splitlm.bench.overlap`).

    .venv/bin/python benchmarks/warmup_overlap.py            # writes benchmarks/warmup-overlap.md
    .venv/bin/python benchmarks/warmup_overlap.py --spec-bench ../shared/data/spec-bench/question.jsonl

Every set under benchmarks/ (prompts*.json), and Spec-Bench's questions when given (their first turns):
per set, how many prompts come within NEAR_TWIN (0.8) or SIMILAR (0.6) of a warm-up request (difflib
ratio of the word sequences), and which. Runs no model; a few seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from splitlm.bench.overlap import NEAR_TWIN, SIMILAR, WarmupIndex, bundled_requests, markdown  # noqa: E402
from splitlm.bench.specbench import read_questions  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec-bench", default=None, help="Spec-Bench's question.jsonl (first turns checked too)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "warmup-overlap.md"), help="the report (Markdown)")
    args = p.parse_args()
    index = WarmupIndex(bundled_requests())
    sets = [
        index.check(f"benchmarks/{path.name}", [(x["id"], x["prompt"]) for x in json.loads(path.read_text())])
        for path in sorted((ROOT / "benchmarks").glob("prompts*.json"))
    ]
    if args.spec_bench:
        questions = read_questions(args.spec_bench)
        sets.append(index.check("Spec-Bench (first turns)", [(f"sb-{q.question_id}", q.turns[0]) for q in questions]))
    text = (
        f"# Benchmark prompts against the bundled warm-up requests\n\n"
        f"`benchmarks/warmup_overlap.py`: each prompt's closest request among the {len(index.requests)} of the "
        f"bundled warm-up file (the `auto` drafter's retrieval corpus), by difflib's ratio of the lowercased "
        f"word sequences. Near-twin: ≥ {NEAR_TWIN}; similar: ≥ {SIMILAR}. Headline sets hold no near-twin "
        f"(`tests/bench/test_overlap.py`).\n\n" + markdown(sets)
    )
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
