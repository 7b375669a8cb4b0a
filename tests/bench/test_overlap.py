"""Near-twins of the warm-up requests: the check finds them, and the frozen headline set holds none."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from splitlm.bench.overlap import NEAR_TWIN, WarmupIndex, bundled_requests, markdown, request_text
from splitlm.bench.prompts import CATEGORIES, load_prompts

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
HEADLINE = BENCHMARKS / "prompts-headline.json"


@pytest.fixture(scope="module")
def index() -> WarmupIndex:
    return WarmupIndex(bundled_requests())


def test_a_request_is_its_user_turn():
    chat = (
        "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\n"
        "Name a colour.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert request_text(chat) == "Name a colour." and request_text("def f():\n") == "def f():\n"


def test_near_twins_of_warmup_requests_are_found(index):
    assert len(index.requests) > 4000
    exact = index.nearest("p", "Write a Python function that checks whether a string is a palindrome.")
    assert exact.score == 1.0 and "palindrome" in exact.request
    assert index.nearest("p", "Write a Python function that checks if a string is a palindrome!").score >= NEAR_TWIN
    assert index.nearest("p", "Why is the sky blue at noon but red at sunset?").score < NEAR_TWIN
    report = markdown(
        [
            index.check(
                "set",
                [
                    ("twin", "write a python function that checks whether a string is a palindrome"),
                    ("other", "Describe a quiet harbour at dawn."),
                ],
            )
        ]
    )
    assert "| set | 2 | 1 | 0 | 1.00 |" in report and "| twin | 1.00 |" in report


def test_the_headline_set_is_frozen_in_shape_and_holds_no_near_twin(index):
    prompts = load_prompts(HEADLINE)
    counts = Counter(p.category for p in prompts)
    assert len(prompts) >= 24 and set(counts) == set(CATEGORIES) and min(counts.values()) >= 6
    assert {p.chat for p in prompts} == {True, False}
    assert {p.category for p in prompts[:4]} == set(CATEGORIES)  # round robin: --limit 4 covers every category
    assert all(set(item) == {"id", "category", "prompt", "chat"} for item in json.loads(HEADLINE.read_text()))
    others = {p.prompt for f in BENCHMARKS.glob("prompts*.json") if f != HEADLINE for p in load_prompts(f)}
    assert not others & {p.prompt for p in prompts}
    twins = [n for n in index.check("headline", [(p.id, p.prompt) for p in prompts]).nearest if n.score >= NEAR_TWIN]
    assert twins == []
