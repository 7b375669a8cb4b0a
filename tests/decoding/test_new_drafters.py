"""Recycled, retrieval (suffix) and head drafts, and `auto` merging them: sequential greedy output
exactly, on random models; the index structures against brute force."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama, write_code_warmup
from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.budget import ComputeFit, StepBudget
from splitlm.decoding.drafters import Drafter, KeyedCalibration, either
from splitlm.decoding.head import DraftHead, HeadRunner, load_head, native_bf16
from splitlm.decoding.local import LocalSession
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.recycle import RecycleTable
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.step import StepResult
from splitlm.decoding.suffix import ContextAutomaton, SuffixIndex
from splitlm.decoding.tree import TokenTree
from splitlm.model.loading import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("new-drafters"), seed=11, vocab_size=64)
    return load_model(path)[0]


def run(model, prompt, n, drafter, cost="measured"):
    stats, out = SpecStats(), []
    for new in decode(
        LocalSession(model),
        DecodeRequest(prompt, n, set(), speculation=Speculation(drafter, StepBudget(max_nodes=128, cost=cost), stats)),
    ):
        out.extend(new)
    return out, stats


def memory_for(model, rng):
    corpus = SuffixIndex([[rng.randrange(3, 64) for _ in range(200)] for _ in range(4)])
    mem = DraftMemory.seeded(corpus)
    d = model.cfg.hidden_size
    torch.manual_seed(0)
    mem.head = HeadRunner(
        DraftHead(d, 32, torch.arange(0, 64, 2)), model.embed_tokens.weight, model.embed_tokens.weight
    )
    return mem


def test_new_drafters_match_sequential(model):
    rng = random.Random(0)
    mem = memory_for(model, rng)
    for _ in range(2):
        prompt = [rng.randrange(3, 64) for _ in range(rng.randrange(3, 16))]
        reference, _ = run(model, prompt, 24, Drafter())
        for mode in ("recycle", "suffix", "head", "auto"):
            for cost in ("measured", "zero"):
                out, stats = run(model, prompt, 24, make_drafter(SpecConfig(mode), memory=mem), cost)
                assert out == reference, (mode, cost)
        mem.past.add(reference)  # later prompts retrieve from this one's output
    assert max(stats.choices) > 20  # zero cost: big trees


def test_head_runner_drafts_in_bf16_as_in_fp32(model):
    d = model.cfg.hidden_size
    torch.manual_seed(1)
    head = DraftHead(d, 32, torch.arange(0, 64))
    w = model.embed_tokens.weight
    exact = HeadRunner(DraftHead(d, 32, torch.arange(0, 64)).requires_grad_(False), w, w, dtype=torch.float32)
    exact.head.load_state_dict(head.state_dict())
    half = HeadRunner(head, w, w, dtype=torch.bfloat16)
    assert half.lm.weight.dtype == half.head.fc1.weight.dtype == torch.bfloat16
    assert head.fc1.weight.dtype == torch.float32  # the runner converts a copy, not the caller's head
    h = torch.randn(6, d)
    (_, p32, ids32), (_, p16, ids16) = exact.step(h, [3, 4, 5, 6, 7, 8], 4), half.step(h, [3, 4, 5, 6, 7, 8], 4)
    assert p16.dtype == torch.float32 and torch.allclose(p16.sum(-1), p32.sum(-1), atol=0.05)
    assert (ids16[:, 0] == ids32[:, 0]).float().mean() >= 0.5  # rounding may swap near-ties, not the drafts' sense
    expected = torch.bfloat16 if native_bf16(w.device) else torch.float32  # the default follows the fixed rule
    assert HeadRunner(DraftHead(d, 32, torch.arange(0, 64)), w, w).dtype == expected


def test_suffix_index_finds_every_occurrence_of_the_longest_match():
    rng = random.Random(3)
    docs = [[rng.randrange(5) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
    ix = SuffixIndex(docs)
    text = [t for d in docs for t in d + [-1]]
    for _ in range(30):
        ctx = [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
        ranges = ix.match(ctx)
        for m, lo, hi in ranges:
            pat = ctx[-m:]
            ends = sorted(i + m for i in range(len(text) - m + 1) if text[i : i + m] == pat)
            got = sorted(len(text) - int(p) for p in ix.sa[lo:hi])  # forward index after the match
            assert got == ends
        longest = ranges[-1][0] if ranges else 0
        if longest < len(ctx):
            pat = ctx[-(longest + 1) :]
            assert not any(text[i : i + len(pat)] == pat for i in range(len(text)))
        for cont in ix.continuations(*ranges[-1][1:], depth=4, limit=50) if ranges else []:
            assert -1 not in cont and 0 < len(cont) <= 4


def test_context_automaton_matches_brute_force():
    rng = random.Random(4)
    sam, text = ContextAutomaton(), []
    for _ in range(120):
        tok = rng.randrange(4)
        sam.add(tok)
        text.append(tok)
        query = text[-rng.randrange(1, 10) :] + [rng.randrange(4)]
        state, length = sam.match(query)
        best = max(
            (
                n
                for n in range(1, len(query) + 1)
                if any(text[i : i + n] == query[-n:] for i in range(len(text) - n + 1))
            ),
            default=0,
        )
        assert length == best
        if length:
            e = sam.end[state]  # the latest end of the match
            assert text[e - length + 1 : e + 1] == query[-length:]
            assert not any(text[i - length + 1 : i + 1] == query[-length:] for i in range(e + 1, len(text)))


def test_recycle_table_seeds_from_bigrams_and_learns_from_passes():
    table = RecycleTable(k=2)
    table.seed(np.array([5, 6, 5, 6, 5, 7, -1, 9, 9]))
    assert table.next[5] == [6, 7] and table.next[9] == [9] and -1 not in table.next
    table.update([5, 8], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert table.next[5] == [1, 2] and table.next[8] == [4, 5]


def test_recycle_pair_rows_win_where_seen_and_the_oldest_pairs_go():
    table = RecycleTable(k=2, max_pairs=2)
    table.update([5, 5], torch.tensor([[1, 2], [3, 4]]), before=[7, 8])  # "7 5" -> 1 2, "8 5" -> 3 4
    assert table.row(7, 5) == ([1, 2], True) and table.row(8, 5) == ([3, 4], True)
    assert table.row(9, 5) == ([3, 4], False)  # an unseen pair: the token's latest row
    table.update([6], torch.tensor([[9, 9]]), before=[None])  # no predecessor: the token table only
    assert table.row(None, 6) == ([9, 9], False) and len(table.pairs) == 2
    table.update([6], torch.tensor([[1, 1]]), before=[5])
    assert (7, 5) not in table.pairs and table.row(5, 6) == ([1, 1], True)


def test_calibration_scores_only_decided_nodes():
    tree = TokenTree.root_only(0)
    a = tree.add(0, 1, 0.5, "a")
    tree.add(a, 2, 0.5, "b")
    tree.add(0, 3, 0.5, "c")
    tree.add(tree.add(0, 4, 0.5, None), 5, 0.5, "d")
    cal = KeyedCalibration(prior_weight=1.0)
    cal.learn(tree, [1, 7])  # 1 accepted, then 7 chosen: b rejected, c rejected, d undecided
    assert cal.counts == {"a": (1.0, 1.0), "b": (0.0, 1.0), "c": (0.0, 1.0)}
    assert cal.p("a", 0.0) == 0.5 and cal.p("zzz", 0.3) == 0.3


def test_cost_curve_is_measured_not_assumed():
    fit = ComputeFit()
    for _ in range(4):
        for t, s in ((1, 0.040), (8, 0.050), (16, 0.052)):
            fit.add(t, s)
    assert fit.predict(16) == pytest.approx(0.052, abs=1e-3)  # flat from 8 to 16, as measured
    assert fit.predict(12) <= fit.predict(16) and fit.predict(64) >= fit.predict(16)
    budget = StepBudget(explore_every=1)
    tree = TokenTree.root_only(0)
    for i in range(40):
        tree.add(0, i + 1, 0.01)
    assert budget.choose(tree).nodes >= 2  # an unmeasured bucket up is tried


def test_a_bucket_not_measured_lately_is_measured_again():
    fit = ComputeFit(stale_after=10)
    for _ in range(3):
        fit.add(16, 0.200)  # measured while the machine was busy
    assert fit.explored(16)
    for _ in range(9):
        fit.add(8, 0.050)
    assert fit.explored(16)
    fit.add(8, 0.050)
    assert not fit.explored(16) and fit.explored(8)  # 10 samples since: worth another look
    fit.add(16, 0.055)
    assert fit.explored(16)


def test_train_head_writes_a_head_the_edge_loads(audit_model_dir, tmp_path, monkeypatch):
    from splitlm.decoding.head import find_head
    from splitlm.decoding.train_head import HeadSettings, train_head
    from splitlm.model.shards import Manifest, split_model
    from splitlm.result_files import file_digest

    monkeypatch.setenv("SPLITLM_CACHE", str(tmp_path / "cache"))
    split = split_model(str(audit_model_dir), head=2, tail=2, out=tmp_path / "split")
    warm = write_code_warmup(tmp_path / "w.jsonl.gz")
    report = train_head(
        str(audit_model_dir),
        split / "edge",
        warmup=warm,
        settings=HeadSettings(max_tokens=3000, vocab=64, inner=32, minutes=0.2, batch=64, lr=5e-3),
        out=tmp_path / "results",
    )
    head = load_head(split / "edge")
    # its report: next to the head, next to the cache's copy, and in the results directory, with the head's digest
    beside = json.loads((split / "edge" / "draft_head.json").read_text())
    assert beside["head_sha256"] == file_digest(split / "edge" / "draft_head.safetensors") == report["head_sha256"]
    assert beside["heldout"] == report["heldout"] and "splitlm train-head --edge" in beside["reproduce"]
    assert Path(report["cached"]).with_suffix(".json").is_file()
    (written,) = (tmp_path / "results").glob("train-head-*.json")
    assert json.loads(written.read_text())["provenance"]["draft_heads"][0]["sha256"] == report["head_sha256"]
    assert head is not None and len(head.vocab_ids) == report["vocab"] <= 64
    assert report["loss_last"] < report["loss_first"]
    cond = report["heldout"]["conditional"]
    assert len(cond) == 4 and all(0.0 <= c <= 1.0 for c in cond)
    # another split of the same model finds the head kept for the model; an unrelated shard does not
    other = split_model(str(audit_model_dir), head=1, tail=1, out=tmp_path / "other")
    model_hash = Manifest.read(other / "edge", "edge").model_hash
    assert find_head(other / "edge", model_hash) == tmp_path / "cache" / "heads" / f"{model_hash}.safetensors"
    assert find_head(other / "edge") is None and find_head(other / "edge", "0" * 32) is None


def test_train_head_reads_the_states_warmup_kept_instead_of_a_second_pass(audit_model_dir, tmp_path, monkeypatch):
    from splitlm.decoding import train_head as th
    from splitlm.decoding.warmup import build_warmup
    from splitlm.model.shards import split_model

    monkeypatch.setenv("SPLITLM_CACHE", str(tmp_path / "cache"))
    split = split_model(str(audit_model_dir), head=2, tail=2, out=tmp_path / "split")
    warm = tmp_path / "w.jsonl.gz"
    build_warmup(str(audit_model_dir), warm, limit=24, batch=12, states=True)

    def no_second_pass(*_a, **_k):
        raise AssertionError("the full model ran over the answers again")

    monkeypatch.setattr(th, "features", no_second_pass)
    report = th.train_head(
        str(audit_model_dir),
        split / "edge",
        warmup=warm,
        settings=th.HeadSettings(max_tokens=3000, vocab=64, inner=32, minutes=0.1, batch=64, lr=5e-3),
    )
    assert report["features"] == "captured by warmup --states" and report["train_answers"] > 0
    assert len(report["heldout"]["conditional"]) == 4 and load_head(split / "edge") is not None


def head_drafter_at(model, seed=2):
    from splitlm.decoding.head import HeadDrafter

    d = model.cfg.hidden_size
    torch.manual_seed(seed)
    drafter = HeadDrafter(
        HeadRunner(
            DraftHead(d, 32, torch.arange(0, 64)),
            model.embed_tokens.weight,
            model.embed_tokens.weight,
            dtype=torch.float32,
        ),
        min_reach=0.0,
        width=1,
        k=2,
    )
    drafter.reset([5, 6, 7])
    drafter.hidden = torch.randn(d)
    return drafter


def test_head_guided_by_the_merged_tree_goes_deeper_along_the_others_votes(model):
    drafter = head_drafter_at(model)
    alone = drafter.propose()
    # the head's own first-ranked chain (width 1: the likeliest child is expanded), each token
    # voted for at 0.95 by "other drafters"
    chain, node = [], 0
    while kids := [i for i in range(len(alone)) if alone.parents[i] == node]:
        node = kids[0]
        chain.append(alone.tokens[node])
    guide = TokenTree.root_only(7)
    guide.add_path(chain, [0.95] * len(chain))
    drafter.min_reach = 0.15
    unguided = drafter.propose()
    guided = drafter.propose(guide=guide)
    assert max(guided.depths()) > max(unguided.depths())
    assert tuple(chain[: max(guided.depths())]) in guided.paths()


def test_after_a_forced_chain_the_head_drafts_from_its_state_rolled_through_the_chain(model):
    """A pass leaves the hidden state before the bonus token; a grammar's forced chain then extends the
    context: the head drafts after the chain as if it had read the bonus and the chain."""
    drafter = head_drafter_at(model)  # reset on [5, 6, 7]: the prompt and the first token
    d = model.cfg.hidden_size
    drafter.verified(TokenTree.root_only(6), [0], [7], StepResult(None, 1, hidden=torch.randn(1, d)))  # the prefill
    tree = TokenTree.root_only(7)
    tree.add(0, 9, 0.5)
    h = torch.randn(2, d)
    drafter.verified(tree, [0, 1], [9, 4], StepResult(None, 2, hidden=h))  # 9 accepted, 4 the bonus
    drafter.extend([9, 4])
    drafter.extend([11, 12, 13])  # the forced chain
    drafted = drafter.propose()
    _, _, ids = drafter.runner.step(drafter.runner.roll(h[1], [4, 11, 12])[None], [13], 2)
    children = [drafted.tokens[i] for i in range(1, len(drafted)) if drafted.parents[i] == 0]
    assert drafted.tokens[0] == 13 and children == ids[0].tolist()
    drafter.verified(TokenTree.root_only(13), [0], [20], StepResult(None, 1, hidden=h[:1]))
    drafter.extend([20])
    assert drafter.known == [] and drafter.rolled() is not None  # nothing to roll after an ordinary pass


def test_the_head_drafts_after_paths_inside_the_tree(model):
    drafter = head_drafter_at(model)
    after = drafter.propose_after([[8, 9], [8, 10, 11]], [0.9, 0.5])
    assert (8, 9) in after.paths() and (8, 10, 11) in after.paths()
    assert any(len(p) > 3 for p in after.paths())  # drafts below the paths' ends
    _, _, ids = drafter.runner.step(drafter.runner.roll(drafter.hidden, [7, 8])[None], [9], 2)
    assert (8, 9, ids[0, 0].item()) in after.paths()


def test_tree_finds_children_by_index_and_keeps_the_first_of_duplicates():
    tree = TokenTree([1, 2, 3, 2], [-1, 0, 1, 0], [1.0, 0.5, 0.4, 0.3])
    assert tree.child(0, 2) == 1 and tree.child(1, 3) == 2 and tree.child(2, 9) is None
    assert tree.add(2, 9, 0.1) == 4 and tree.child(2, 9) == 4
    assert tree.add(0, 2, 0.9) == 1 and tree.scores[1] == 0.9
    pruned = tree.pruned(3, [1.0, 0.9, 0.8, 0.1, 0.05])
    assert pruned.tokens == [1, 2, 3] and pruned.child(1, 3) == 2


def test_a_tree_added_under_a_node_shares_its_existing_nodes_and_maps_every_node():
    tree = TokenTree([1, 2, 3], [-1, 0, 1], [1.0, 0.5, 0.4], [None, "a", "b"])
    other = TokenTree([7, 3, 4, 5], [-1, 0, 1, 0], [1.0, 0.2, 0.6, 0.3], [None, "x", "y", "z"])
    where = tree.add_tree(other, at=1, combine=either)
    assert where == [1, 2, 3, 4]  # its root is node 1, its 3 is node 2 (already there)
    assert tree.parents[3:] == [2, 1] and tree.tokens[3:] == [4, 5] and tree.keys[3:] == ["y", "z"]
    assert tree.scores[2] == pytest.approx(either(0.4, 0.2)) and tree.keys[2] == "b"
