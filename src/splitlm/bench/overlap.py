"""Near-twins between a benchmark's prompts and the bundled warm-up requests.

The `auto` drafter retrieves from the model's own answers to the warm-up requests
(`splitlm.decoding.warmup`): a benchmark prompt that is nearly one of those requests gets its answer
retrieved rather than drafted, and its τ says more about the corpus than about drafting. This
module measures how close each prompt comes to any warm-up request.

Similarity: `difflib.SequenceMatcher.ratio` over the two texts' lowercased word sequences (runs of
letters and digits; a warm-up request is its user turn, without the chat template around it):
2·M / (|a| + |b|), M the words of the longest matching blocks. "Write a Python function that checks
whether a string is a palindrome." against "... checks if a string is a palindrome" gives 0.87;
requests that share only the template ("Write a Python function that ...") give 0.4-0.6.
A prompt at `NEAR_TWIN` (0.8) or above is a near-twin: kept out of headline sets; `SIMILAR` (0.6)
and above is reported.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

NEAR_TWIN = 0.8
SIMILAR = 0.6
USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def request_text(warmup_prompt: str) -> str:
    """A warm-up record's request: its user turn when it is in a chat template, else the raw text."""
    m = USER_TURN.search(warmup_prompt)
    return m.group(1) if m else warmup_prompt


def words(text: str) -> list[str]:
    """The lowercased runs of letters and digits of `text`."""
    return re.findall(r"[a-z0-9]+", text.lower())


@dataclass
class Nearest:
    """A prompt's closest warm-up request."""

    prompt_id: str
    score: float  # difflib ratio of the word sequences, 0..1
    request: str  # the warm-up request (its user turn)


@dataclass
class SetOverlap:
    """One prompt set against the warm-up requests."""

    name: str
    nearest: list[Nearest] = field(default_factory=list)  # one per prompt, in the set's order

    @property
    def near_twins(self) -> list[Nearest]:
        return [n for n in self.nearest if n.score >= NEAR_TWIN]

    @property
    def similar(self) -> list[Nearest]:
        return [n for n in self.nearest if SIMILAR <= n.score < NEAR_TWIN]

    @property
    def max_score(self) -> float:
        return max((n.score for n in self.nearest), default=0.0)


class WarmupIndex:
    """The warm-up requests as word sequences, searched for a prompt's closest one."""

    def __init__(self, requests: list[str]):
        self.requests = requests
        self.seqs = [words(r) for r in requests]

    def nearest(self, prompt_id: str, text: str) -> Nearest:
        """The closest request to `text` (the cheap upper bounds of difflib skip most of them)."""
        matcher = difflib.SequenceMatcher(autojunk=False)
        matcher.set_seq2(words(text))
        best, where = 0.0, 0
        for i, seq in enumerate(self.seqs):
            matcher.set_seq1(seq)
            if matcher.real_quick_ratio() <= best or matcher.quick_ratio() <= best:
                continue
            if (r := matcher.ratio()) > best:
                best, where = r, i
        return Nearest(prompt_id, round(best, 3), self.requests[where] if self.requests else "")

    def check(self, name: str, prompts: list[tuple[str, str]]) -> SetOverlap:
        """Each (id, text) of a prompt set against the requests."""
        return SetOverlap(name, [self.nearest(pid, text) for pid, text in prompts])


def bundled_requests(model_hash: str | None = None) -> list[str]:
    """The requests of the bundled warm-up file (the default model's, else the only one bundled)."""
    from splitlm.decoding.warmup import BUNDLED_DIR, read_warmup_records

    files = sorted(BUNDLED_DIR.glob(f"{model_hash or '*'}.jsonl.gz"))
    return [request_text(r["prompt"]) for f in files[:1] for r in read_warmup_records(f)]


def markdown(sets: list[SetOverlap]) -> str:
    """A table per set: its near-twins and similar prompts with their closest request; a summary first."""
    lines = [
        f"| set | prompts | near-twins (≥ {NEAR_TWIN:.2f}) | similar (≥ {SIMILAR:.2f}) | highest |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {s.name} | {len(s.nearest)} | {len(s.near_twins)} | {len(s.similar)} | {s.max_score:.2f} |" for s in sets
    ]
    for s in sets:
        listed = sorted(s.near_twins + s.similar, key=lambda n: -n.score)
        if not listed:
            continue
        lines += ["", f"**{s.name}**", "", "| prompt | score | closest warm-up request |", "|---|---|---|"]
        lines += [f"| {n.prompt_id} | {n.score:.2f} | {n.request[:100].replace('|', '/')} |" for n in listed]
    return "\n".join(lines) + "\n"
