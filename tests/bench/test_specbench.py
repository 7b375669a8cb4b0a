"""Spec-Bench as a bench prompt set: the reader, the stated subset, second turns in their conversation,
the per-category report; one tiny run on the bundled model."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from splitlm import SplitLMError
from splitlm.bench import specbench
from splitlm.bench.prompts import Prompt

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec-bench" / "question.jsonl"


def write_questions(path: Path, per_category: int = 10) -> Path:
    """A file in Spec-Bench's format: MT-bench's eight sub-categories (two turns), then the five others."""
    rows, qid = [], 81
    for sub in specbench.MT_BENCH:
        for i in range(per_category):
            rows.append({"question_id": qid, "category": sub, "turns": [f"{sub} {i} first?", f"{sub} {i} again?"]})
            qid += 1
    for cat in specbench.CATEGORIES[1:]:
        for i in range(8 * per_category):
            rows.append({"question_id": qid, "category": cat, "turns": [f"{cat} {i}?"]})
            qid += 1
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_the_reader_maps_mt_bench_and_selects_evenly_spaced_questions(tmp_path):
    path = write_questions(tmp_path / "question.jsonl")
    assert specbench.is_spec_bench(path) and not specbench.is_spec_bench(tmp_path / "missing.jsonl")
    questions = specbench.read_questions(path)
    assert Counter(q.category for q in questions) == dict.fromkeys(specbench.CATEGORIES, 80)
    chosen = specbench.select(questions, per_category=16)
    assert Counter(q.category for q in chosen) == dict.fromkeys(specbench.CATEGORIES, 16)
    mt = [q for q in chosen if q.category == "mt_bench"]
    assert Counter(q.subcategory for q in mt) == dict.fromkeys(specbench.MT_BENCH, 2)  # stratified
    assert [q.question_id for q in mt][:3] == [81, 86, 91]  # positions 0, 5, 10 of 80, by question_id
    assert specbench.select(questions, ["qa", "rag"], 3) == [
        q for q in specbench.select(questions, per_category=3) if q.category in ("qa", "rag")
    ]
    with pytest.raises(SplitLMError, match="no question in poetry"):
        specbench.select(questions, ["poetry"])


def test_a_mode_cap_runs_the_same_questions_as_the_smaller_subset(tmp_path):
    questions = specbench.read_questions(write_questions(tmp_path / "question.jsonl"))
    chosen = specbench.select(questions, per_category=20, mode_questions={"recycle": 10})
    capped = [q.question_id for q in chosen if "recycle" not in q.skip_modes]
    assert capped == [q.question_id for q in specbench.select(questions, per_category=10)]
    assert all(not q.skip_modes or q.skip_modes == {"recycle"} for q in chosen)


def test_second_turns_follow_their_first_with_its_answer(tmp_path):
    prompts = specbench.load_spec_bench(write_questions(tmp_path / "q.jsonl", 1), ["mt_bench", "qa"], 2)
    assert [(p.id, p.follows) for p in prompts] == [
        ("sb-81", None),
        ("sb-81-t2", "sb-81"),
        ("sb-85", None),
        ("sb-85-t2", "sb-85"),
        ("sb-105", None),
        ("sb-109", None),
    ]
    assert all(p.chat for p in prompts)

    class Tokenizer:  # a chat template that spells the messages out
        added_tokens_decoder: dict = {}  # no special tokens

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

        def apply_chat_template(self, messages, **kwargs):
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

        def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
            class Encoded:
                input_ids = [ord(c) for c in text]

            return Encoded()

    tok = Tokenizer()
    specbench.fill_follow_up(prompts[0], prompts, {}, tok)
    assert prompts[0].ids == []  # a first turn is tokenized as any prompt
    specbench.fill_follow_up(prompts[1], prompts, {"sb-81": [7, 8]}, tok)
    text = "".join(map(chr, prompts[1].ids))
    assert text == "user:writing 0 first?|assistant:w7 w8|user:writing 0 again?|assistant:"


def _row(mode: str, pid: str, cat: str, tokens: int, trips: int, seconds: float) -> dict:
    return {
        "mode": mode,
        "prompt_id": pid,
        "category": cat,
        "rtt_ms": 80.0,
        "decode_tokens": tokens,
        "round_trips": trips,
        "decode_s": seconds,
        "tokens_per_round_trip": tokens / trips,
    }


def test_summary_per_category_against_split_seq_on_the_same_questions():
    runs = [
        _row("split-seq", "sb-1", "qa", 10, 10, 1.0),
        _row("split-seq", "sb-2", "qa", 10, 10, 3.0),
        _row("split-seq", "sb-3", "rag", 10, 10, 1.0),
        _row("auto", "sb-1", "qa", 10, 4, 0.5),
        _row("auto", "sb-2", "qa", 10, 5, 1.0),
        _row("auto", "sb-3", "rag", 12, 4, 0.5),
        _row("recycle", "sb-1", "qa", 10, 5, 0.5),
    ]  # capped: one question
    doc = {"runs": runs, "environment": {"model": {"name": "SmolLM2-135M-Instruct"}}}
    section = specbench.summary(doc)
    assert section["categories"] == ["qa", "rag"]
    auto = section["modes"]["auto"]
    assert auto["qa"]["tokens_per_round_trip"] == pytest.approx(20 / 9)
    assert auto["qa"]["tok_s_vs_split_seq"] == pytest.approx((20 / 1.5) / (20 / 4.0))
    assert auto["all"]["questions"] == 3 and auto["rag"]["tokens_per_round_trip"] == 3.0
    recycle = section["modes"]["recycle"]["qa"]  # against split-seq on sb-1 only, not on both
    assert recycle["questions"] == 1 and recycle["tok_s_vs_split_seq"] == pytest.approx(20 / 10)
    text = specbench.markdown(section)
    assert "| auto [2] | 2.22 (2.67×) | 3.00 (2.40×) |" in text
    assert "EAGLE-2 | 4.35" in text and "Vicuna-7B" in text and "SmolLM2-135M-Instruct" in text


def test_other_prompt_files_refuse_the_spec_bench_options_and_filter_categories(tmp_path):
    path = tmp_path / "p.json"
    rows = [("a", "code"), ("b", "creative"), ("c", "code"), ("d", "structured")]
    path.write_text(json.dumps([{"id": i, "category": c, "prompt": "x", "chat": True} for i, c in rows]))
    assert [p.id for p in specbench.load_prompt_set(path)] == ["a", "b", "c", "d"]
    assert [p.id for p in specbench.load_prompt_set(path, ["code"])] == ["a", "c"]
    assert [p.id for p in specbench.load_prompt_set(path, ["structured", "code"])] == ["a", "c", "d"]
    with pytest.raises(SplitLMError, match="no prompt in poetry"):
        specbench.load_prompt_set(path, ["code", "poetry"])
    with pytest.raises(SplitLMError, match="need Spec-Bench"):
        specbench.load_prompt_set(path, per_category=2)


@pytest.mark.skipif(not SHARED.is_file(), reason="the Spec-Bench data folder is not next to this checkout")
def test_the_shipped_question_file():
    questions = specbench.read_questions(SHARED)
    assert len(questions) == 480 and {q.category for q in questions} == set(specbench.CATEGORIES)
    assert sum(len(q.turns) == 2 for q in questions) == 80
    prompts = specbench.load_spec_bench(SHARED, per_category=20)
    assert len(prompts) == 6 * 20 + 20  # MT-bench's 20 bring their second turns
    assert isinstance(prompts[0], Prompt) and prompts[1].follows == prompts[0].id


@pytest.mark.slow
def test_a_spec_bench_run_on_the_bundled_model(bundled_dir, tmp_path, capsys):
    """One two-turn MT-bench question and one QA question: the second turn runs in its conversation, with
    the first turn's answer; the JSON and the report carry the per-category table."""
    from transformers import AutoTokenizer

    from splitlm.cli import main

    path = tmp_path / "question.jsonl"
    path.write_text(
        json.dumps({"question_id": 1, "category": "writing", "turns": ["Name a colour.", "Another?"]})
        + "\n"
        + json.dumps({"question_id": 2, "category": "qa", "turns": ["Who wrote Hamlet?"]})
        + "\n"
    )
    argv = [
        "bench",
        "--prompts",
        str(path),
        "--max-new-tokens",
        "6",
        "--rtt-ms",
        "0",
        "--wire-dtype",
        "fp32",
        "--out",
        str(tmp_path / "out"),
        "--no-plots",
        "--no-memory",
        "--modes",
        "split-seq,auto-nowarmup",
        "--mode-questions",
        "auto-nowarmup=1",
        "--categories",
        "mt_bench",
    ]
    assert main(argv) == 0
    assert "## Spec-Bench, by category" in capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [p["id"] for p in doc["prompts"]] == ["sb-1", "sb-1-t2"] and doc["prompts"][1]["follows"] == "sb-1"
    runs = {(r["mode"], r["prompt_id"]): r for r in doc["runs"]}
    assert set(runs) == {(m, p) for m in ("split-seq", "auto-nowarmup") for p in ("sb-1", "sb-1-t2")}
    assert all(r["exact_match"] for r in runs.values())  # fp32 wire: the reference's tokens
    tok = AutoTokenizer.from_pretrained(bundled_dir)
    answer = tok.decode(runs["split-seq", "sb-1"]["token_ids"], skip_special_tokens=True)
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Another?"},
    ]
    expected = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids
    assert doc["prompts"][1]["prompt_tokens"] == len(expected)
    cells = doc["spec_bench"]["modes"]
    assert doc["spec_bench"]["categories"] == ["mt_bench"] and cells["split-seq"]["mt_bench"]["questions"] == 1
    assert cells["split-seq"]["all"]["tokens_per_round_trip"] == 1.0
    assert doc["provenance"]["command"][:2] == ["splitlm", "bench"]
