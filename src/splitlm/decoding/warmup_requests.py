"""The generic requests the warm-up corpus answers (`splitlm.decoding.warmup`): templates here, their
words in the package's data/warmup_requests.json.

Programming tasks in several languages, structured-data requests, short creative pieces, everyday
questions. The second list (the `_2` entries, FACTS and ADVICE) was added when the draft head's held-out
acceptance was found to grow with its training data (half the first list's answers: 0.55 at depth 1,
all of them: 0.60): same kinds, new subjects. Nothing here comes from a benchmark prompt or a user.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

REQUESTS_FILE = Path(__file__).resolve().parent.parent / "data" / "warmup_requests.json"


@dataclass(frozen=True)
class RequestWords:
    """The words the templates are filled with (records and pairs: two strings each)."""

    langs: list[str]
    code_tasks: list[str]
    code_howtos: list[str]
    code_concepts: list[str]
    code_classes: list[str]
    sql_queries: list[str]
    formats: list[str]
    records: list[list[str]]
    creative_kinds: list[str]
    subjects: list[str]
    asks: list[str]
    goals: list[str]
    whys: list[str]
    pairs: list[list[str]]
    more_records: list[list[str]]
    more_formats: list[str]
    emails: list[str]
    lists: list[str]
    explains: list[str]
    hobbies: list[str]
    more_pairs: list[list[str]]
    more_kinds: list[str]
    more_subjects: list[str]
    code_tasks_2: list[str]
    code_howtos_2: list[str]
    code_concepts_2: list[str]
    records_2: list[list[str]]
    creative_kinds_2: list[str]
    subjects_2: list[str]
    goals_2: list[str]
    whys_2: list[str]
    explains_2: list[str]
    pairs_2: list[list[str]]
    hobbies_2: list[str]
    emails_2: list[str]
    lists_2: list[str]
    facts: list[str]
    advice: list[str]


WORDS = RequestWords(**json.loads(REQUESTS_FILE.read_text(encoding="utf-8")))


def capitalized(text: str) -> str:
    return text[0].upper() + text[1:]


def records(formats: list[str], kinds: list[list[str]]) -> list[str]:
    return [
        f"Give {fmt} with three {things}, with the fields {fields}."
        for fmt, (things, fields) in itertools.product(formats, kinds)
    ]


def first_list(w: RequestWords) -> list[str]:
    """About 2 500 requests (unshuffled)."""
    out = [f"Write a {lang} function that {task}." for lang, task in itertools.product(w.langs, w.code_tasks)]
    out += [
        f"Write a {lang} class {name} with a few useful methods."
        for name in w.code_classes
        for lang in ["Python", "Java", "JavaScript"]
    ]
    out += [f"Write an SQL query that returns {q}." for q in w.sql_queries]
    out += [f"How do I {how} in {lang}?" for how, lang in itertools.product(w.code_howtos, w.langs[:4])]
    out += [f"Explain {c} in programming, with a short example." for c in w.code_concepts]
    out += records(w.formats, w.records)
    out += [f"Write {kind} about {subj}." for kind, subj in itertools.product(w.creative_kinds, w.subjects)]
    out += [ask.format(goal) for ask, goal in itertools.product(w.asks, w.goals)]
    for why in w.whys:
        out += [f"Why {why}?", f"Explain to a child why {why}."]
    out += [f"What is the difference between {a} and {b}?" for a, b in w.pairs]
    out += records(w.formats + w.more_formats, w.more_records)
    out += records(w.more_formats, w.records)
    out += [f"Write a short email {e}." for e in w.emails]
    for x in w.lists:
        out += [f"List five {x} as a numbered list.", f"Give a bulleted list of {x}, one sentence each."]
    for x in w.explains:
        out += [f"Explain {x}.", f"In simple words, explain {x}.", f"Explain to a child {x}."]
    for h in w.hobbies:
        out += [f"I want to {h}. Where should I start?", f"What are common mistakes when people {h}?"]
    for a, b in w.more_pairs:
        out += [f"What is the difference between {a} and {b}?", f"{capitalized(a)} or {b}? Give pros and cons."]
    out += [
        f"Write {kind} about {subj}."
        for kind, subj in itertools.product(w.more_kinds + w.creative_kinds, w.more_subjects)
    ]
    return out


def second_list(w: RequestWords) -> list[str]:
    """About 1 800 more requests in the first list's kinds, languages and record formats (unshuffled)."""
    langs = w.langs
    out = [f"Write a {lang} function that {task}." for lang, task in itertools.product(langs, w.code_tasks_2)]
    out += [f"How do I {how} in {lang}?" for how, lang in itertools.product(w.code_howtos_2, langs[:4])]
    out += [f"Explain {c} in programming, with a short example." for c in w.code_concepts_2]
    out += records(w.formats + w.more_formats, w.records_2)
    out += [f"Write {kind} about {subj}." for kind, subj in itertools.product(w.creative_kinds_2, w.subjects_2)]
    out += [ask.format(goal) for ask, goal in itertools.product(w.asks, w.goals_2)]
    for why in w.whys_2:
        out += [f"Why {why}?", f"Explain to a child why {why}."]
    for x in w.explains_2:
        out += [f"Explain {x}.", f"In simple words, explain {x}.", f"Explain to a child {x}."]
    for a, b in w.pairs_2:
        out += [f"What is the difference between {a} and {b}?", f"{capitalized(a)} or {b}? Which is better?"]
    for h in w.hobbies_2:
        out += [f"I want to {h}. Where should I start?", f"What are common mistakes when people {h}?"]
    out += [f"Write a short email {e}." for e in w.emails_2]
    for x in w.lists_2:
        out += [f"List five {x} as a numbered list.", f"Give a bulleted list of {x}, one sentence each."]
    for x in w.facts:
        out += [f"Tell me three interesting facts about {x}.", f"What makes {x} special?"]
    for x in w.advice:
        out += [f"{capitalized(x)}. What should I do?", f"{capitalized(x)}. Any advice?"]
    return out


def instructions(seed: int = 0) -> list[str]:
    """The generic requests (about 4 300), in a fixed order: the first list shuffled, then the second
    shuffled (after the first: a warm-up file made from the first list alone grows)."""
    out = first_list(WORDS)
    random.Random(seed).shuffle(out)
    more = second_list(WORDS)
    random.Random(seed + 1).shuffle(more)
    return out + more
