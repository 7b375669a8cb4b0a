"""Constrained decoding through the edge over a real cloud: the screened greedy head takes per-row
masks, `Edge.generate(GenerationRequest(response_format=...))` speculates with the grammar and equals constrained
sequential decoding; outputs validate; the bundled model (slow) does the same on real prompts."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from conftest import JSON_EOS, make_tiny_llama, save_merge_tokenizer
from splitlm.decoding.grammar import GrammarError, GrammarSpec
from splitlm.edge import Edge, EdgeConfig, GenerationRequest
from splitlm.model.greedy_head import GreedyHead

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "state": {"enum": ["open", "closed"]},
        "labels": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 5}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "state", "labels", "owner"],
    "additionalProperties": False,
}


def test_screened_head_takes_a_mask_per_row():
    torch.manual_seed(0)
    weight = torch.randn(300, 32)
    head = GreedyHead(weight, screen=True)
    h = torch.randn(6, 32)
    allowed = torch.rand(6, 300) < 0.05
    allowed[:, 7] = True
    allowed[2] = False
    allowed[2, 123] = True  # a forced row: one token allowed
    plain = (h @ weight.T).masked_fill(~allowed, -torch.inf).argmax(-1)
    assert head.argmax(h, allowed).tolist() == plain.tolist()
    assert int(head.argmax(h, allowed)[2]) == 123


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from splitlm.cloud.server import BackgroundServer
    from splitlm.model.shards import split_model

    path = tmp_path_factory.mktemp("structured-tiny")
    size = save_merge_tokenizer(path)
    eos = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(JSON_EOS)
    make_tiny_llama(path, seed=8, vocab_size=size, eos_token_id=eos, bos_token_id=eos)
    split = split_model(str(path), head=2, tail=2, out=tmp_path_factory.mktemp("structured-split"))
    with BackgroundServer(split / "cloud") as server:
        yield split, server


def test_response_format_speculates_exactly(served):
    split, server = served
    with Edge(split / "edge", server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        prompt = 'Ticket: {"id": 12, "state": "open"} Again: '
        seq = edge.generate(GenerationRequest(prompt, 96, spec="none", response_format=SCHEMA))
        auto = edge.generate(GenerationRequest(prompt, 96, spec="auto", response_format=SCHEMA))
        streamed = "".join(
            edge.stream(GenerationRequest(prompt, 96, spec="ngram", response_format=GrammarSpec.json_schema(SCHEMA)))
        )
        assert auto.token_ids == seq.token_ids
        assert streamed == seq.text
        assert auto.finish_reason == "stop", auto.text
        jsonschema.validate(json.loads(auto.text), SCHEMA)
        assert seq.stats.round_trips == len(seq.token_ids)  # sequential: one token per round trip
        assert auto.stats.round_trips < len(auto.token_ids) / 2  # forced keys, quotes and braces ride free
        assert auto.stats.grammar.forced_tokens > 10
        regex = edge.generate(
            GenerationRequest("Code: ", 24, spec="auto", response_format=GrammarSpec.regex(r"[A-Z]{3}-[0-9]{2,4}"))
        )
        assert (
            regex.token_ids
            == edge.generate(
                GenerationRequest("Code: ", 24, response_format=GrammarSpec.regex(r"[A-Z]{3}-[0-9]{2,4}"))
            ).token_ids
        )
        with pytest.raises(GrammarError, match="cannot compile the regular expression"):
            edge.generate(GenerationRequest("x", 4, response_format=GrammarSpec.regex("(unclosed")))


def test_a_prefill_guess_the_model_does_not_take_is_cropped_on_both_sides(served, monkeypatch):
    """The prefill carries a guess after the forced opening (here a wrong one on purpose); the model
    picks another token, edge and cloud drop the guess's cache entries, and the output is sequential
    decoding's."""
    from splitlm.decoding.grammar import GrammarState
    from splitlm.edge.session import EdgeSession

    likely, crop, crops = GrammarState.likely, EdgeSession.crop, []

    def wrong(state):
        guess = likely(state)
        others = [] if guess is None else [t for t in state.allowed().nonzero().flatten().tolist() if t != guess]
        return others[-1] if others else guess

    def counted(session, n):
        crops.append(n)
        crop(session, n)

    monkeypatch.setattr(GrammarState, "likely", wrong)
    monkeypatch.setattr(EdgeSession, "crop", counted)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    split, server = served
    with Edge(split / "edge", server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        for prompt in ("Record: ", 'Again {"name": "ab", "n": 3} and: '):
            seq = edge.generate(GenerationRequest(prompt, 40, spec="none", response_format=schema))
            auto = edge.generate(GenerationRequest(prompt, 40, spec="auto", response_format=schema))
            assert auto.token_ids == seq.token_ids
    assert len(crops) == 2


BUNDLED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "year": {"type": "integer"},
        "colours": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "kind": {"enum": ["fruit", "vegetable", "grain"]},
    },
    "required": ["name", "year", "kind", "colours"],
    "additionalProperties": False,
}
BUNDLED_PROMPTS = [
    "Describe the banana as JSON with its name, the year it reached Europe, its kind and colours.",
    "Give a JSON record for rice: name, year first farmed, kind, colours.",
]


@pytest.mark.slow
def test_bundled_constrained_auto_equals_sequential(bundled_split, bundled_server):
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        for prompt in BUNDLED_PROMPTS:
            seq = edge.generate(GenerationRequest(prompt, 96, chat=True, spec="none", response_format=BUNDLED_SCHEMA))
            auto = edge.generate(GenerationRequest(prompt, 96, chat=True, spec="auto", response_format=BUNDLED_SCHEMA))
            assert auto.token_ids == seq.token_ids, prompt
            jsonschema.validate(json.loads(auto.text), BUNDLED_SCHEMA)
            assert auto.stats.round_trips < seq.stats.round_trips


def test_cli_generate_with_a_json_schema_and_a_regex(served, tmp_path, capsys):
    from splitlm.cli import main

    split, server = served
    schema_file = tmp_path / "ticket.json"
    schema_file.write_text(json.dumps(SCHEMA))
    common = [
        "generate",
        "--edge",
        str(split / "edge"),
        "--cloud",
        server.url,
        "--wire-dtype",
        "fp32",
        "--max-new-tokens",
        "96",
        "--spec",
        "auto",
        "--json",
    ]
    assert main([*common, "--prompt", "Ticket: ", "--json-schema", str(schema_file)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and out["stats"]["grammar"]["forced_tokens"] > 0
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert main([*common, "--prompt", "Code: ", "--regex", "[a-c]{2}[0-9]"]) == 0
    assert re.fullmatch("[a-c]{2}[0-9]", json.loads(capsys.readouterr().out)["text"])
    assert main([*common, "--prompt", "x", "--json-schema", str(tmp_path / "missing.json")]) == 1
    assert "cannot read the JSON schema" in capsys.readouterr().err


def test_auto_drafts_without_copies_where_the_engine_cannot_read_the_tokenizer(monkeypatch, caplog):
    import threading
    from types import SimpleNamespace

    import splitlm.edge.grammars as grammars

    def unreadable(*args, **kwargs):
        raise GrammarError("the grammar engine cannot read this tokenizer: test")

    monkeypatch.setattr(grammars.GrammarTokenizer, "from_hf", unreadable)
    edge_grammars = grammars.EdgeGrammars(SimpleNamespace(tokenizer=object(), lock=threading.Lock()), 64, [2])
    assert edge_grammars.text_view() is None and edge_grammars.text_view() is None
    assert sum("without copies" in r.message for r in caplog.records) == 1  # said once
    assert grammars.EdgeGrammars(SimpleNamespace(tokenizer=None, lock=threading.Lock()), 64, [2]).text_view() is None
