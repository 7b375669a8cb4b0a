"""Spec-Bench (github.com/hemingkx/Spec-Bench): its question file as a bench prompt set, a stated
stratified subset of it, and its per-category report next to the published figures.

    splitlm bench --prompts ../shared/data/spec-bench/question.jsonl --per-category 20 \\
        --mode-questions recycle=10,suffix=10 --modes split-seq,auto,recycle,suffix

Format: JSON lines `{"question_id", "category", "turns": [user message, ...]}`. Six categories: the 80
MT-bench conversations (`writing`, `roleplay`, ... `humanities`: Spec-Bench's `mt_bench`, two turns
each), `translation`, `summarization`, `qa`, `math_reasoning`, `rag` (80 each). Every turn is a user
message in the chat template. An MT-bench question's second turn is run as the follow-up in the same
conversation: the first turn, the full model's greedy answer to it (the reference, which every
exact mode reproduces), then the second message; so every mode sees the same second-turn context.

Subset (`--per-category N`): in each category, ordered by question_id, the N questions at positions
floor(i·n/N), i = 0..N-1, of its n (evenly spaced; MT-bench's ten per sub-category come in id order,
so its N = 20 takes two of each). `--mode-questions MODE=M` runs MODE on M of those N only, the ones at
positions floor(j·N/M) of the N (for N = 20, M = 10: every other one, the same questions as
`--per-category 10`). tok/s × split-seq in the Spec-Bench table is measured on the questions both ran.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from splitlm import SplitLMError
from splitlm.bench.prompts import Prompt, load_prompts

CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
BASELINE = "split-seq"
# the data folder's README (Vicuna-7B, greedy, batch 1; its leaderboard and the methods' papers):
# mean accepted tokens per verification step, all categories together
PUBLISHED = (
    ("PLD", "1.55-1.74"),
    ("Lookahead", "1.61-1.66"),
    ("REST", "1.63-1.82"),
    ("Medusa", "2.32"),
    ("Token Recycling", "2.73-2.83"),
    ("SAM-Decoding + Token Recycling", "2.98"),
    ("Hydra", "3.24-3.35"),
    ("EAGLE", "3.57"),
    ("EAGLE-2", "4.35"),
    ("SAM-Decoding + EAGLE-2", "4.61"),
)
PUBLISHED_MODEL = "Vicuna-7B"


@dataclass
class Question:
    question_id: int
    category: str  # Spec-Bench's: mt_bench for MT-bench's eight
    subcategory: str  # the file's own category
    turns: list[str]
    skip_modes: frozenset[str] = field(default_factory=frozenset)


def is_spec_bench(path: str | Path) -> bool:
    """Whether `path` is in Spec-Bench's format (JSON lines with question_id and turns)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open(encoding="utf-8") as f:
        first = f.readline()
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and "question_id" in row and "turns" in row


def read_questions(path: str | Path) -> list[Question]:
    """The questions of a Spec-Bench file, by question_id."""
    questions = []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                turns = [t for t in row["turns"] if isinstance(t, str) and t]
                sub = str(row["category"])
                questions.append(Question(int(row["question_id"]), "mt_bench" if sub in MT_BENCH else sub, sub, turns))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise SplitLMError(f"{path}: line {n} is not a Spec-Bench question ({e})") from None
            if not turns:
                raise SplitLMError(f"{path}: question {row['question_id']} has no turns")
    return sorted(questions, key=lambda q: q.question_id)


def evenly_spaced(n: int, k: int) -> list[int]:
    """k of the positions 0..n-1: floor(i·n/k) for i < k (all of them when k >= n)."""
    return list(range(n)) if k >= n else [i * n // k for i in range(k)]


def check_categories(asked: list[str] | None, present: list[str], what: str) -> None:
    """SplitLMError naming the `--categories` asked for that no `what` of the file is in, and those it has."""
    unknown = sorted(set(asked or ()) - set(present))
    if unknown:
        known = sorted(set(present))
        raise SplitLMError(f"--categories: no {what} in {', '.join(unknown)} (the file has {', '.join(known)})")


def select(
    questions: list[Question],
    categories: list[str] | None = None,
    per_category: int | None = None,
    mode_questions: dict[str, int] | None = None,
) -> list[Question]:
    """The stated subset: the `categories` asked for (all by default), `per_category` evenly spaced
    questions of each (all by default); each question notes the modes whose `mode_questions` cap leaves it out."""
    check_categories(categories, [q.category for q in questions], "question")
    chosen = []
    for cat in dict.fromkeys(q.category for q in questions):
        if categories and cat not in categories:
            continue
        group = [q for q in questions if q.category == cat]
        picked = [group[i] for i in evenly_spaced(len(group), per_category or len(group))]
        for mode, cap in (mode_questions or {}).items():
            kept = set(evenly_spaced(len(picked), cap))
            for i, q in enumerate(picked):
                if i not in kept:
                    q.skip_modes = q.skip_modes | {mode}
        chosen += picked
    return chosen


def to_prompts(questions: list[Question]) -> list[Prompt]:
    """One chat prompt per turn; a second turn follows its first (`Prompt.follows`)."""
    prompts = []
    for q in questions:
        first = Prompt(f"sb-{q.question_id}", q.category, q.turns[0], chat=True, skip_modes=q.skip_modes)
        prompts.append(first)
        for n, turn in enumerate(q.turns[1:], 2):
            prompts.append(
                Prompt(
                    f"sb-{q.question_id}-t{n}",
                    q.category,
                    turn,
                    chat=True,
                    skip_modes=q.skip_modes,
                    follows=prompts[-1].id,
                )
            )
    return prompts


def load_spec_bench(
    path: str | Path,
    categories: list[str] | None = None,
    per_category: int | None = None,
    mode_questions: dict[str, int] | None = None,
) -> list[Prompt]:
    """The bench prompts of a Spec-Bench file's stated subset (`select`)."""
    return to_prompts(select(read_questions(path), categories, per_category, mode_questions))


def load_prompt_set(
    path: str | Path,
    categories: list[str] | None = None,
    per_category: int | None = None,
    mode_questions: dict[str, int] | None = None,
) -> list[Prompt]:
    """A bench prompt file: Spec-Bench's questions (their stated subset), else a JSON prompt list (whole, or
    the prompts of `categories` in the file's order)."""
    if is_spec_bench(path):
        return load_spec_bench(path, categories, per_category, mode_questions)
    if per_category or mode_questions:
        raise SplitLMError(f"--per-category and --mode-questions need Spec-Bench's question file, not {path}")
    prompts = load_prompts(path)
    if not categories:
        return prompts
    check_categories(categories, [p.category for p in prompts], "prompt")
    return [p for p in prompts if p.category in categories]


def question_of(prompt_id: str) -> str:
    """The question a turn's prompt belongs to: sb-81-t2 -> sb-81."""
    return re.sub(r"-t\d+$", "", prompt_id)


def conversation(prompt: Prompt, prompts: dict[str, Prompt], answers: dict[str, str]) -> list[dict]:
    """The messages before `prompt`'s own: each earlier turn of its conversation and its answer."""
    earlier: list[dict] = []
    while prompt.follows:
        before = prompts[prompt.follows]
        earlier = [
            {"role": "user", "content": before.prompt},
            {"role": "assistant", "content": answers[before.id]},
            *earlier,
        ]
        prompt = before
    return earlier


def fill_follow_up(prompt: Prompt, prompts: list[Prompt], answers: dict[str, list[int]], tokenizer) -> None:
    """A later turn's token ids (`prompt.follows`; others are left as they are): its conversation in the chat
    template, each earlier turn answered by `answers` (token ids per prompt id: the reference's)."""
    from splitlm.edge.text import encode_messages

    if not prompt.follows:
        return
    texts = {pid: tokenizer.decode(ids, skip_special_tokens=True) for pid, ids in answers.items()}
    earlier = conversation(prompt, {p.id: p for p in prompts}, texts)
    prompt.ids = encode_messages(tokenizer, [*earlier, {"role": "user", "content": prompt.prompt}])


def pooled(rows: list[dict]) -> tuple[float | None, float | None]:
    """(τ, tok/s) of a group of per-prompt rows: decoding tokens over round trips and over seconds."""
    tokens = sum(r["decode_tokens"] for r in rows)
    trips, seconds = sum(r["round_trips"] for r in rows), sum(r["decode_s"] for r in rows)
    return (tokens / trips if trips else None), (tokens / seconds if seconds else None)


def cell(rows: list[dict], mode: str, keep: Callable[[dict], bool]) -> dict:
    """One mode's figures over the rows `keep` selects; its tok/s against split-seq's on the same prompts."""
    mine = [r for r in rows if r["mode"] == mode and keep(r)]
    prompts = {r["prompt_id"] for r in mine}
    base = [r for r in rows if r["mode"] == BASELINE and r["prompt_id"] in prompts]
    tau, tok_s = pooled(mine)
    base_tok_s = pooled(base)[1] if len(base) == len(mine) else None
    return {
        "prompts": len(mine),
        "questions": len({question_of(p) for p in prompts}),
        "tokens_per_round_trip": tau,
        "tok_s": tok_s,
        "tok_s_vs_split_seq": tok_s / base_tok_s if tok_s and base_tok_s else None,
    }


def summary(doc: dict) -> dict:
    """The Spec-Bench section of a bench document: per network mode, per category and overall, τ and
    tok/s × split-seq (on the same prompts); the published figures beside them."""
    rows = [r for r in doc["runs"] if r.get("tokens_per_round_trip") is not None]
    rtt = min((r["rtt_ms"] for r in rows), default=0.0)
    rows = [r for r in rows if r["rtt_ms"] == rtt]
    cats = [c for c in CATEGORIES if any(r["category"] == c for r in rows)]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    table = {
        m: {**{c: cell(rows, m, lambda r, c=c: r["category"] == c) for c in cats}, "all": cell(rows, m, lambda r: True)}
        for m in modes
    }
    return {
        "rtt_ms": rtt,
        "categories": cats,
        "modes": table,
        "model": doc["environment"]["model"]["name"],
        "published": {
            "model": PUBLISHED_MODEL,
            "figure": "mean accepted tokens per step, all categories",
            "methods": dict(PUBLISHED),
        },
    }


def _cell_text(c: dict) -> str:
    if c["tokens_per_round_trip"] is None:
        return "–"
    ratio = f" ({c['tok_s_vs_split_seq']:.2f}×)" if c["tok_s_vs_split_seq"] else ""
    return f"{c['tokens_per_round_trip']:.2f}{ratio}"


def markdown(section: dict) -> str:
    """The Spec-Bench table and the published figures beside it."""
    cats = section["categories"]
    lines = [
        f"## Spec-Bench, by category (RTT {section['rtt_ms']:g} ms)",
        "",
        "tokens per round trip (tok/s × split-seq on the same questions); [questions per category]",
        "",
        "| mode | " + " | ".join(cats) + " | all |",
        "|---|" + "---|" * (len(cats) + 1),
    ]
    for mode, cells in section["modes"].items():
        n = max((cells[c]["questions"] for c in cats), default=0)
        lines.append(f"| {mode} [{n}] | " + " | ".join(_cell_text(cells[c]) for c in [*cats, "all"]) + " |")
    pub = section["published"]
    lines += [
        "",
        f"Published on Spec-Bench ({pub['model']}, greedy, batch 1; {pub['figure']}); ours: "
        f"{section['model']}, a different and 50× smaller model, through the split at the RTT above:",
        "",
        "| method | mean accepted tokens per step |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value} |" for name, value in pub["methods"].items()]
    return "\n".join(lines) + "\n"
