"""Constrained decoding: grammar-aware speculation (every drafter) equals sequential constrained
decoding token for token, greedy and seeded sampling; rejected drafts are never sent; forced tokens
ride as certain nodes; every output matches its grammar."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace

import jsonschema
import pytest
import torch

from conftest import JSON_EOS, make_tiny_llama, save_merge_tokenizer
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.grammar import (
    GrammarError,
    GrammarSpec,
    GrammarTokenizer,
    closed_objects,
    compile_grammar,
    grammar_from_format,
)
from splitlm.decoding.grammar_decode import GrammarStats
from splitlm.decoding.grammar_tree import constrain
from splitlm.decoding.local import LocalSession
from splitlm.decoding.logprobs import LogprobRecorder
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.sampling import SamplingConfig
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.step import StepInput, StepResult
from splitlm.decoding.tree import TokenTree
from splitlm.model.loading import load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "active", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}( ok)?"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("grammar-tiny")
    size = save_merge_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    eos = tok.convert_tokens_to_ids(JSON_EOS)
    make_tiny_llama(path, seed=21, vocab_size=size, eos_token_id=eos, bos_token_id=eos)
    model = load_model(path)[0]
    return model, tok, GrammarTokenizer.from_hf(tok, size, [eos])


def decode_text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != tok.eos_token_id])


def sequential(model, gt, spec, prompt, n, sampling=None, logprobs=None):
    gstats = GrammarStats()
    out = []
    for new in decode(
        LocalSession(model),
        DecodeRequest(
            prompt,
            n,
            set(),
            sampling=sampling,
            logprobs=logprobs,
            grammar=compile_grammar(spec, gt).start(),
            grammar_stats=gstats,
        ),
    ):
        out += new
    return out, gstats


def speculative(model, gt, spec, prompt, n, drafter, sampling=None, step_cap=None):
    stats, gstats = SpecStats(), GrammarStats()
    out = []
    session = LocalSession(model)
    session.max_step_tokens = step_cap  # a cloud window's cap on the tokens of one step
    for new in decode(
        session,
        DecodeRequest(
            prompt,
            n,
            set(),
            sampling=sampling,
            grammar=compile_grammar(spec, gt).start(),
            grammar_stats=gstats,
            speculation=Speculation(drafter, StepBudget(), stats),
        ),
    ):
        out += new
    return out, stats, gstats


class NoisyOracle(Drafter):
    """Proposes the true continuation to a random depth, corrupted somewhere, plus random branches."""

    name = "oracle"

    def __init__(self, reference, prompt_len, rng, vocab):
        self.reference, self.prompt_len, self.rng, self.vocab = reference, prompt_len, rng, vocab

    def propose(self):
        done = len(self.context) - self.prompt_len
        truth = self.reference[done : done + self.rng.randrange(0, 10)]
        if truth and self.rng.random() < 0.4:
            truth[self.rng.randrange(len(truth))] = self.rng.randrange(self.vocab)
        tree = TokenTree.root_only(self.context[-1])
        tree.add_path(truth, [0.9] * len(truth))
        while len(tree) < 14:
            tree.add(self.rng.randrange(len(tree)), self.rng.randrange(self.vocab), 0.1)
        return tree


SPECS = [GrammarSpec.json_schema(SCHEMA), GrammarSpec.regex(REGEX), GrammarSpec.json_object()]


def check_valid(tok, spec: GrammarSpec, ids: list[int]) -> None:
    text = decode_text(tok, ids)
    if spec.kind == "regex":
        assert re.fullmatch(spec.source, text), text
    else:
        jsonschema.validate(json.loads(text), spec.schema)


@pytest.mark.parametrize("spec", SPECS[:2], ids=["schema", "regex"])
def test_sequential_is_argmax_over_the_allowed_tokens(setup, spec):
    """The reference itself, against a brute-force loop: full-context logits, the grammar's mask, argmax."""
    model, tok, gt = setup
    prompt = tok("Fill in: ").input_ids
    out, gstats = sequential(model, gt, spec, prompt, 60)
    state, ctx = compile_grammar(spec, gt).start(), list(prompt)
    for t in out:
        with torch.inference_mode():
            logits = LocalSession(model).forward(StepInput(ctx)).out[-1]
        assert t == int(logits.masked_fill(~state.allowed(), -torch.inf).argmax())
        state.advance(t)
        ctx.append(t)
    assert out[-1] == tok.eos_token_id and state.finished or state.accepting
    check_valid(tok, spec, out)
    assert gstats.forced_tokens > 0 or spec.kind == "regex"


CASES = [(m, 0) for m in ("none", "ngram", "suffix", "recycle", "auto", "lookahead", "auto-window")] + [
    ("auto", 1),
    ("auto", 2),
]


@pytest.mark.parametrize(("mode", "which"), CASES, ids=[f"{m}-{['schema', 'regex', 'object'][w]}" for m, w in CASES])
def test_every_drafter_equals_sequential(setup, mode, which):
    spec = SPECS[which]
    model, tok, gt = setup
    prompt = tok('Example: {"name": "ab", "age": 7, "role": "user"} Now: ').input_ids
    reference, _ = sequential(model, gt, spec, prompt, 48)
    out, stats, gstats = speculative(model, gt, spec, prompt, 48, make_drafter(SpecConfig(mode)))
    assert out == reference
    if reference[-1] == tok.eos_token_id:
        check_valid(tok, spec, out)
    if spec.kind != "regex":
        assert stats.steps < len(out) - 1  # forced tokens ride: fewer round trips than tokens
        assert gstats.forced_tokens > 0


@pytest.mark.parametrize("seed", range(2))
def test_noisy_trees_greedy_and_sampled(setup, seed):
    """Drafts that are partly the truth, partly corrupted, partly random: the same tokens as sequential
    decoding (greedy, and sampling with a seed); rejected drafts are pruned before they are sent."""
    model, tok, gt = setup
    rng = random.Random(seed)
    spec = SPECS[seed % 2]
    prompt = tok(f"Record {seed}: ").input_ids
    for sampling in (None, SamplingConfig(temperature=0.9, top_p=0.95, seed=seed)):
        reference, _ = sequential(model, gt, spec, prompt, 90, sampling)
        oracle = NoisyOracle(reference, len(prompt), rng, len(tok))
        out, stats, gstats = speculative(model, gt, spec, prompt, 90, oracle, sampling)
        assert out == reference
        assert gstats.rejected_drafts > 0
        assert stats.accepted_drafts > 0


def test_auto_with_a_head_drafts_after_forced_chains_and_equals_sequential(setup, monkeypatch):
    """The head drafts after the chain at the root (rolled through it) and after the chains inside the
    tree (`propose_after`, grafted through the grammar): the tokens stay those of sequential decoding."""
    from splitlm.decoding.auto import DraftMemory
    from splitlm.decoding.head import DraftHead, HeadDrafter, HeadRunner
    from splitlm.decoding.suffix import SuffixIndex

    model, tok, gt = setup
    example = tok('{"name": "ab", "age": 7, "role": "user", "active": true, "tags": ["a"]}').input_ids
    torch.manual_seed(0)
    memory = DraftMemory.seeded(
        SuffixIndex([example * 3]),
        HeadRunner(
            DraftHead(model.cfg.hidden_size, 32, torch.arange(len(tok))),
            model.embed_tokens.weight,
            model.embed_tokens.weight,
        ),
    )
    calls = []
    inner = HeadDrafter.propose_after
    monkeypatch.setattr(HeadDrafter, "propose_after", lambda self, *a, **k: calls.append(a) or inner(self, *a, **k))
    spec = GrammarSpec.json_schema(SCHEMA)
    for text in ("Go: ", "Example: "):
        prompt = tok(text).input_ids + example + tok(" Now: ").input_ids
        reference, _ = sequential(model, gt, spec, prompt, 60)
        out, _, gstats = speculative(model, gt, spec, prompt, 60, make_drafter(SpecConfig("auto"), memory=memory))
        assert out == reference and gstats.forced_tokens > 0
    assert calls  # open chain ends inside trees were drafted after


LONG = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}, "count": {"type": "integer"}},
    "required": ["notes", "count"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("limit", [23, 31, 40])
def test_near_the_length_limit_the_answer_is_closed_the_same_way_by_every_mode(setup, limit):
    """An answer that would run past `max_new_tokens` is completed in the tokens left (the grammar's
    closing), identically in sequential and speculative decoding, greedy and sampled."""
    model, tok, gt = setup
    spec = GrammarSpec.json_schema(LONG)
    prompt = tok("Notes: ").input_ids
    unlimited, _ = sequential(model, gt, spec, prompt, 200)
    assert len(unlimited) > limit  # without the limit the answer runs on
    for sampling in (None, SamplingConfig(temperature=0.9, seed=3)):
        reference, _ = sequential(model, gt, spec, prompt, limit, sampling)
        assert len(reference) <= limit and reference[-1] != tok.eos_token_id
        jsonschema.validate(json.loads(decode_text(tok, reference)), LONG)  # complete, and valid
        for drafter in (Drafter(), make_drafter(SpecConfig("auto"))):
            out, _, _ = speculative(model, gt, spec, prompt, limit, drafter, sampling)
            assert out == reference
    if len(unlimited) > limit + 64:  # far from the limit nothing changes
        assert sequential(model, gt, spec, prompt, limit + 64)[0][: limit - 8] == unlimited[: limit - 8]


def test_closing_is_short_and_leaves_the_state_alone(setup):
    model, tok, gt = setup
    state = compile_grammar(GrammarSpec.json_schema(LONG), gt).start()
    for t in tok('{"notes": ["ab", "c').input_ids:
        state.advance(t)
    consumed = state.consumed
    closing = state.closing(32)
    assert state.consumed == consumed and state.closing(32) == closing
    assert tok.decode(closing) == '"], "count": 0}'
    assert state.closing(len(closing) - 1) is None


def test_rejected_drafts_are_never_sent_and_forced_nodes_are_certain(setup):
    model, tok, gt = setup
    state = compile_grammar(GrammarSpec.json_schema(SCHEMA), gt).start()
    opening = state.forced_chain(32)
    assert tok.decode(opening) == '{"name":'  # the forced bytes, less the last token that could merge on
    tree = TokenTree.root_only(5)
    bad = tok("[").input_ids[0]
    tree.add(0, bad, 0.9)  # JSON objects open with '{': rejected
    tree.add(1, opening[0], 0.9)  # under a rejected node: gone with it
    walked = constrain(tree, state)
    assert walked.rejected == 2
    assert walked.tree.tokens[1 : len(opening) + 1] == opening  # added as a chain of certain nodes
    assert all(walked.tree.certain(i) for i in range(1, len(opening) + 1))
    assert bad not in walked.tree.tokens
    allowed = walked.allowed(list(range(len(walked.tree))), len(tok))
    assert allowed[0].sum() == 1 and allowed[0, opening[0]]
    budget = StepBudget()
    choice = budget.choose(walked.tree)
    assert choice.reach[1 : len(opening) + 1] == [1.0] * len(opening)  # the budget counts them as certain


def test_a_graft_walks_only_the_new_nodes_through_the_grammar(setup):
    from splitlm.decoding.grammar_tree import graft

    model, tok, gt = setup
    state = compile_grammar(GrammarSpec.json_schema(SCHEMA), gt).start()
    walked = constrain(TokenTree.root_only(5), state)
    k = len(state.forced_chain(32))  # the opening chain's end, `{"name":` (a choice of ` ` or ` "` follows)
    quote, bad, letters = tok(' "').input_ids[0], tok("[").input_ids[0], tok("ab").input_ids[0]
    have = walked.tree.child(k, quote)
    before = len(walked.tree)
    extra = TokenTree.root_only(walked.tree.tokens[k])
    extra.add(extra.add(0, bad, 0.9), quote, 0.9)  # the grammar rejects `[` here: its subtree goes with it
    extra.add(extra.add(0, quote, 0.8), letters, 0.7)  # ` "` is in the tree already: only `ab` is new
    graft(walked, extra, k, state)
    assert walked.rejected == 2 and walked.tree.child(k, bad) is None
    assert walked.tree.child(k, quote) == have and walked.tree.scores[have] != 0.8  # left as it was
    node = walked.tree.child(have, letters)
    assert node is not None and node >= before and walked.tree.scores[node] == 0.7
    assert len(walked.rows) == len(walked.tree) and state.consumed == 0  # every node has its mask; state restored


def test_a_small_choice_joins_the_tree_whole(setup):
    """Where the grammar allows only a few tokens (an enum's start, a boolean, a comma or a bracket) the
    ones no drafter proposed join the tree with an equal share of the chance, each followed by the chain
    its choice forces; output stays that of sequential decoding."""
    import numpy as np

    from splitlm.decoding.grammar import mask_words
    from splitlm.decoding.grammar_tree import CHOICE, SMALL_CHOICE, small_choice

    model, tok, gt = setup
    prompt = tok("Go: ").input_ids
    spec = GrammarSpec.json_schema(SCHEMA)
    reference, _ = sequential(model, gt, spec, prompt, 60)
    state = compile_grammar(spec, gt).start()
    seen = 0
    for token in reference[:-1]:
        row = np.zeros(mask_words(gt.vocab_size), dtype=np.int32)
        if state.fill_mask(row) is None and (few := small_choice(row, SMALL_CHOICE)) and len(few) > 1:
            walked = constrain(TokenTree.root_only(token), state)
            kids = [i for i in range(1, len(walked.tree)) if walked.tree.parents[i] == 0]
            assert sorted(walked.tree.tokens[i] for i in kids) == sorted(few)
            assert all(walked.tree.scores[i] == 1 / len(few) and walked.tree.keys[i] is CHOICE for i in kids)
            assert walked.choices >= len(few) and walked.rejected == 0
            seen += 1
        state.advance(token)
    assert seen >= 2  # the role's enum and the boolean at least
    assert small_choice(np.full(mask_words(gt.vocab_size), -1, dtype=np.int32), SMALL_CHOICE) is None
    out, stats, gstats = speculative(model, gt, spec, prompt, 60, Drafter())
    assert out == reference and stats.accepted_drafts > 0  # choice nodes accepted without a drafter


def test_a_drafted_word_break_inside_a_string_gets_the_strings_close(setup):
    """Where a drafted child after a word begins another word or punctuation inside a JSON string, the
    string's closing token joins the tree (scored by which: a space or punctuation), followed by the
    next key the grammar forces; nowhere else."""
    from splitlm.decoding.grammar import PUNCT_LED, SPACE_LED
    from splitlm.decoding.grammar_tree import VALUE_END_SCORES, add_value_ends

    _, tok, gt = setup
    state = compile_grammar(GrammarSpec.json_schema(SCHEMA), gt).start()
    opening = tok('{"name": "ab').input_ids
    for t in opening:
        state.advance(t)
    space, dot, x, b = (tok(c).input_ids[0] for c in (" ", ".", "x", "b"))
    (close,) = tok('",').input_ids
    for child, lead in ((space, SPACE_LED), (dot, PUNCT_LED), (x, None)):
        tree = TokenTree.root_only(opening[-1])
        tree.add(0, child, 0.5)
        walked = constrain(tree, state)
        add_value_ends(walked, StepBudget().reach(walked.tree), state, 0)
        node = walked.tree.child(0, close)
        if lead is None:  # a word goes on: no close
            assert node is None and len(walked.tree) == 2
            continue
        assert node is not None and walked.tree.scores[node] == VALUE_END_SCORES[lead]
        assert not walked.tree.certain(node)
        chain, at = [], node
        while kids := walked.tree.kids().get(at, []):
            (at,) = kids
            assert walked.tree.certain(at)
            chain.append(walked.tree.tokens[at])
        assert tok.decode(chain) == ' "age": '
        assert len(walked.rows) == len(walked.tree)
    tree = TokenTree.root_only(space)  # after a space, no word ends
    tree.add(0, b, 0.5)
    tree.add(1, space, 0.5)
    state.advance(space)
    walked = constrain(tree, state)
    add_value_ends(walked, StepBudget().reach(walked.tree), state, 0)
    assert walked.tree.child(0, close) is None and walked.tree.child(1, close) is not None


def test_the_drafter_drafts_after_the_leaves_the_grammar_added(setup):
    """Open ends: leaves where a forced chain or a small choice ends and the model's choice begins, not
    a drafter's own leaves (it drafted as far as it would) nor a leaf whose state allows one token."""
    import numpy as np

    from splitlm.decoding.grammar import mask_words
    from splitlm.decoding.grammar_decode import GrammarShape
    from splitlm.decoding.grammar_tree import CHOICE, ConstrainedTree
    from splitlm.decoding.tree import FORCED

    model, tok, gt = setup
    state = compile_grammar(GrammarSpec.json_schema(SCHEMA), gt).start()
    many, one = np.full(mask_words(gt.vocab_size), -1, dtype=np.int32), np.zeros(mask_words(gt.vocab_size), np.int32)
    one[0] = 1
    tree = TokenTree.root_only(5)
    forced, chosen = tree.add(0, 6, 1.0, FORCED), tree.add(0, 7, 0.5, CHOICE)
    tree.add(0, 8, 0.6, ("head", 1))  # a drafter's leaf
    tree.add(0, 9, 0.7, CHOICE)  # allows one token next: that one would be forced, not drafted
    inner = tree.add(0, 10, 0.9, CHOICE)
    tree.add(inner, 11, 0.9, ("head", 1))
    walked = ConstrainedTree(tree, [many, many, many, many, one, many, many])
    shape = GrammarShape(Drafter(), StepBudget(), state, GrammarStats())
    assert [i for _, i in shape.open_ends(walked, 0)] == [forced, chosen]
    assert [i for _, i in shape.open_ends(walked, forced)] == [chosen]  # the root's own chain is not the tree's


def test_the_budget_sends_forced_chains_first(setup):
    model, tok, gt = setup
    prompt = tok("Go: ").input_ids
    spec = GrammarSpec.json_schema(SCHEMA)
    reference, _ = sequential(model, gt, spec, prompt, 48)
    capped, stats, _ = speculative(model, gt, spec, prompt, 48, Drafter(), step_cap=3)
    assert capped == reference  # 3 tokens a step: chains are cut into several steps, never lost
    assert max(stats.choices) <= 3
    free, free_stats, gfree = speculative(model, gt, spec, prompt, 48, Drafter())
    assert free == reference and free_stats.steps < stats.steps
    assert gfree.forced_tokens >= 10 and gfree.rejected_drafts == 0  # no drafter: only the grammar's chains
    assert free_stats.steps + gfree.forced_tokens <= len(free)  # every forced token saves a round trip


def test_the_forced_start_rides_in_the_prefill_with_its_logprobs(setup):
    """`{"name":` is forced before the model's first choice and ` "` likely follows: both go up with the
    prompt, and the prefill's logits pick the name's first token; each token's logprob is sequential
    decoding's."""
    model, tok, gt = setup
    prompt = tok("Go: ").input_ids
    spec = GrammarSpec.json_schema(SCHEMA)
    seq_rec, spec_rec = LogprobRecorder(3), LogprobRecorder(3)
    reference, _ = sequential(model, gt, spec, prompt, 40, logprobs=seq_rec)
    opening = compile_grammar(spec, gt).start().forced_chain(32)
    for rec in (spec_rec, None):
        steps = list(
            decode(
                LocalSession(model),
                DecodeRequest(
                    prompt,
                    40,
                    set(),
                    logprobs=rec,
                    grammar=compile_grammar(spec, gt).start(),
                    grammar_stats=GrammarStats(),
                    speculation=Speculation(Drafter(), StepBudget(), SpecStats()),
                ),
            )
        )
        assert [t for new in steps for t in new] == reference
        assert tok.decode(steps[0][: len(opening) + 1]) == '{"name": "' and len(steps[0]) == len(opening) + 2
    assert [t.token for t in spec_rec.tokens] == reference
    for a, b in zip(spec_rec.tokens, seq_rec.tokens, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and [i for i, _ in a.top] == [i for i, _ in b.top]


class SpaceLover(LocalSession):
    """The model, but the lone space token wins wherever the grammar allows it."""

    def __init__(self, model, space: int):
        super().__init__(model)
        self.space = space

    def forward(self, request: StepInput) -> StepResult:
        step = super().forward(replace(request, argmax=False, allowed=None))
        logits = step.out.clone()  # [R, V] (an inference tensor: not writable outside inference mode)
        logits[:, self.space] = logits.max() + 10.0
        if request.allowed is not None:
            logits = logits.masked_fill(~request.allowed, -torch.inf)
        step.out = logits.argmax(-1) if request.argmax else logits
        return step


def test_a_prefill_guess_the_model_does_not_take_is_cropped(setup):
    """The prefill guesses ` "` after `{"name":`; a model that writes the lone space there instead gets
    it, the guess leaves the cache, and the output stays that of sequential decoding."""
    model, tok, gt = setup
    prompt = tok("Go: ").input_ids
    spec = GrammarSpec.json_schema(SCHEMA)
    state = compile_grammar(spec, gt).start()
    opening = state.forced_chain(32)
    for t in opening:
        state.advance(t)
    space = next(t for t in state.allowed().nonzero().flatten().tolist() if tok.decode([t]) == " ")
    assert tok.decode([state.likely()]) == ' "'
    reference = []
    for new in decode(
        SpaceLover(model, space),
        DecodeRequest(prompt, 30, set(), grammar=compile_grammar(spec, gt).start(), grammar_stats=GrammarStats()),
    ):
        reference += new
    assert reference[len(opening)] == space  # sequential takes the space, not the guessed ` "`
    session = SpaceLover(model, space)
    steps = list(
        decode(
            session,
            DecodeRequest(
                prompt,
                30,
                set(),
                grammar=compile_grammar(spec, gt).start(),
                grammar_stats=GrammarStats(),
                # trees sized by a cost that no machine's load changes, so the steps fall where they always do
                speculation=Speculation(make_drafter(SpecConfig("auto")), StepBudget(cost="zero"), SpecStats()),
            ),
        )
    )
    assert steps[0] == opening + [space]  # the guess was not taken: the space is the prefill's pick
    assert [t for new in steps for t in new] == reference
    assert session.length == len(prompt) + len(reference) - 1  # every cache entry is an emitted token's


def test_compile_errors_and_response_formats(setup):
    _, _, gt = setup
    for bad in (GrammarSpec.regex("(x"), GrammarSpec.lark("start: foo"), GrammarSpec.json_schema({"type": "bogus"})):
        with pytest.raises(GrammarError, match="cannot compile"):
            compile_grammar(bad, gt)
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        GrammarSpec("xml")
    assert grammar_from_format(None) is None and grammar_from_format({"type": "text"}) is None
    assert grammar_from_format({"type": "json_object"}) == GrammarSpec.json_object()
    wrapped = grammar_from_format(
        {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    )
    assert wrapped.schema == SCHEMA and wrapped.name == "p"
    assert grammar_from_format(SCHEMA).schema == SCHEMA
    assert list(grammar_from_format(SCHEMA).schema["properties"]) == list(
        SCHEMA["properties"]
    )  # the order is the output's
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    assert grammar_from_format(Person).schema["required"] == ["name", "age"]
    with pytest.raises(GrammarError):
        grammar_from_format(3)


def test_objects_that_list_their_properties_take_no_other_keys(setup):
    _, _, gt = setup
    person = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def takes_another_key(schema) -> bool:
        state = compile_grammar(GrammarSpec.json_schema(schema), gt).start()
        for token in gt.ll.tokenize_str('{"a": 1'):
            state.advance(token)
        return bool(state.allowed()[gt.ll.tokenize_str(",")[0]])

    assert not takes_another_key(person)
    assert takes_another_key({**person, "additionalProperties": True})
    assert takes_another_key({**person, "additionalProperties": {"type": "string"}})


def test_closed_objects_keeps_what_a_schema_says_about_other_keys():
    inner = {"type": "object", "properties": {"x": {"type": "string"}}}
    closed = {**inner, "additionalProperties": False}
    schema = {
        "type": "object",
        "$defs": {"Inner": inner},
        "properties": {
            "ref": {"$ref": "#/$defs/Inner"},
            "maybe": {"anyOf": [inner, {"type": "null"}]},
            "many": {"type": "array", "items": inner},
            "open": {**inner, "additionalProperties": True},
            "both": {"allOf": [inner, {"properties": {"y": {"type": "integer"}}}]},
            "named": {**inner, "patternProperties": {"^z": {}}},
        },
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False and out["$defs"]["Inner"] == closed
    props = out["properties"]
    assert props["maybe"]["anyOf"][0] == closed and props["many"]["items"] == closed
    assert props["open"]["additionalProperties"] is True and "additionalProperties" not in props["named"]
    assert props["both"] == schema["properties"]["both"]  # closing one branch would refuse the other's keys
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_forced_text_a_special_token_spells_is_written_in_plain_tokens(tmp_path):
    """Qwen's tokenizer spells `<tool_call>` as one special token; the grammar matches bytes and refuses it,
    so the forced text goes out as the plain tokens that spell it (it once failed the request)."""
    from transformers import AutoTokenizer

    save_merge_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    special = tok.convert_tokens_to_ids("<tool_call>")
    gt = GrammarTokenizer.from_hf(tok, len(tok), [tok.convert_tokens_to_ids(JSON_EOS)])
    state = compile_grammar(GrammarSpec.lark('start: "<tool_call>\\n" "ok"'), gt).start()
    assert state.forced() != special and not state.allowed()[special]
    written = state.closing(32)  # the forced token at each state, else the first allowed
    assert special not in written and tok.decode(written) == "<tool_call>\nok"
