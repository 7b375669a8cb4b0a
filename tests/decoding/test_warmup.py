"""The warm-up corpus: generic prompts, generation into a gzip'd JSON-lines file, and where the edge finds it."""

import gzip
import json

import pytest
import torch

from splitlm import SplitLMError
from splitlm.cli import main
from splitlm.decoding import warmup
from splitlm.decoding.warmup import WARMUP_FILE, build_warmup, find_warmup, instructions, read_warmup


def test_instructions_are_fixed_and_varied():
    first, again = instructions(), instructions()
    assert first == again and len(set(first)) == len(first) > 400
    for word in ("Python", "JSON", "poem", "How can I"):
        assert any(word in q for q in first)


def test_instructions_stay_clear_of_the_benchmark_prompts_subjects():
    # docs/speculative.md: the warm-up list is not tuned to benchmarks/prompts*.json
    text = " ".join(instructions()).lower()
    for subject in (
        "planet",
        "lighthouse",
        "fizzbuzz",
        "stack",
        "queue",
        "houseplant",
        "rainbow",
        "twinkle",
        "budget",
        "interview",
        "penguin",
        "dragon",
        "astronaut",
        "debounce",
        "bakery",
    ):
        assert subject not in text, subject


def test_build_warmup_writes_one_answer_per_prompt(audit_model_dir, tmp_path):
    lines = []
    out = tmp_path / "w.jsonl.gz"
    report = build_warmup(str(audit_model_dir), out, limit=5, batch=2, progress=lines.append)
    assert report["prompts"] == 5 and report["tokens"] > 0 and out.is_file()
    # status lines; the per-batch progress is a bar on a terminal (splitlm.progress)
    assert len(lines) == 2 and lines[0].startswith("loading ") and lines[1].startswith("5 prompts to answer, 2 at")
    texts = read_warmup(out)
    assert len(texts) == 5 and sum(len(t) for t in texts) > 0
    with gzip.open(out, "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    assert len(set(prompts)) == 5  # no chat template in this tokenizer: plain requests and code snippets
    assert not (tmp_path / "w.jsonl.gz.part").exists()


def test_build_warmup_keeps_what_the_file_already_answers(audit_model_dir, tmp_path):
    out = tmp_path / "w.jsonl.gz"
    build_warmup(str(audit_model_dir), out, limit=3, batch=2)
    first = read_warmup(out)
    lines = []
    report = build_warmup(str(audit_model_dir), out, limit=5, batch=2, progress=lines.append)
    assert report["kept"] == 3 and report["prompts"] == 2
    assert lines[1].endswith("3 answers kept, 2 prompts to go")
    texts = read_warmup(out)
    assert len(texts) == 5 and texts[:3] == first
    with gzip.open(out, "rt") as f:
        assert len({json.loads(line)["prompt"] for line in f}) == 5


def test_find_warmup_prefers_the_edge_file_then_the_bundled_one(tmp_path, monkeypatch):
    bundled = tmp_path / "bundled"
    bundled.mkdir()
    monkeypatch.setattr(warmup, "BUNDLED_DIR", bundled)
    edge = tmp_path / "edge"
    edge.mkdir()
    assert find_warmup(edge, "abc") is None
    (bundled / "abc.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "p", "text": "t"}\n'))
    assert find_warmup(edge, "abc") == bundled / "abc.jsonl.gz"
    assert find_warmup(edge, "other") is None
    (edge / WARMUP_FILE).write_bytes(gzip.compress(b'{"prompt": "p", "text": "own"}\n'))
    assert read_warmup(find_warmup(edge, "abc")) == ["own"]


def test_a_broken_warmup_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(SplitLMError, match="not a warm-up file"):
        read_warmup(bad)


def test_cli_warmup_needs_one_destination(tmp_path, capsys):
    assert main(["warmup", "--model", "x"]) != 0
    assert "exactly one of --edge" in capsys.readouterr().err
    assert main(["warmup", "--edge", str(tmp_path / "missing")]) != 0
    assert "not found" in capsys.readouterr().err


def test_warmup_states_are_the_full_models_states_for_each_answer_token(audit_model_dir, tmp_path):
    """`--states` keeps, per answer, the final-normed state that chose each new token: the same states the
    full model gives over prompt + answer (train_head.features), and their greedy tokens are the answer."""
    from transformers import AutoTokenizer

    from splitlm.decoding.train_head import captured_sequences, features
    from splitlm.model.loading import load_model

    out = tmp_path / "w.jsonl.gz"
    build_warmup(str(audit_model_dir), out, limit=4, batch=2, states=True)
    assert warmup.captured_path(out) == tmp_path / "w-states.pt"
    captured = warmup.read_captured(warmup.captured_path(out))
    records = warmup.read_warmup_records(out)
    assert set(captured) == {r["prompt"] for r in records}
    model, _ = load_model(str(audit_model_dir))
    tok = AutoTokenizer.from_pretrained(audit_model_dir)
    for r in records:
        a = captured[r["prompt"]]
        prompt = tok(r["prompt"], add_special_tokens=False).input_ids
        ((h, g),) = features(model, [prompt + a.ids.tolist()])
        chose = slice(len(prompt) - 1, len(prompt) - 1 + len(a.ids))  # the prompt's last position onwards
        assert torch.equal(g[chose], a.ids)
        assert torch.allclose(a.states.float(), h[chose].float(), atol=0.05, rtol=0.02)
    seqs, starts, data = captured_sequences(records, captured, unroll=1)
    assert len(seqs) == len(records) and starts == [1] * len(records)
    for s, (states, g) in zip(seqs, data, strict=True):
        assert len(s) == len(states) == len(g) and s[1:] == g[:-1].tolist()


def test_warmup_states_grow_with_the_file_and_a_bad_file_is_one_line(audit_model_dir, tmp_path):
    out = tmp_path / "w.jsonl.gz"
    build_warmup(str(audit_model_dir), out, limit=2, batch=2, states=True)
    first = warmup.read_captured(warmup.captured_path(out))
    build_warmup(str(audit_model_dir), out, limit=3, batch=2, states=True)
    grown = warmup.read_captured(warmup.captured_path(out))
    assert len(first) == 2 and len(grown) == 3
    assert all(torch.equal(grown[p].states, a.states) for p, a in first.items())
    warmup.captured_path(out).write_bytes(b"not torch")
    with pytest.raises(SplitLMError, match="not a file of captured warm-up states"):
        warmup.read_captured(warmup.captured_path(out))
