"""Pipelined speculation through a real (in-process) cloud: output identical to sequential decoding,
caches equal to a recomputation, and two requests really in flight on one connection."""

import random

import pytest
import torch

from conftest import make_tiny_llama
from splitlm.cloud.server import BackgroundServer
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.pipeline import sync_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.sampling import SamplingConfig
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.step import StepInput
from splitlm.decoding.tree import TokenTree
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.request import GenerationRequest
from splitlm.model.shards import split_model

VOCAB = 64


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    model = make_tiny_llama(tmp_path_factory.mktemp("pipe-model"), seed=21, vocab_size=VOCAB)
    split = split_model(str(model), head=2, tail=2, out=tmp_path_factory.mktemp("pipe-split"))
    with (
        BackgroundServer(split / "cloud") as server,
        Edge(split / "edge", server.url, EdgeConfig(wire_dtype="fp32")) as e,
    ):
        e.server = server
        yield e


class Scripted(Drafter):
    """Drafts the true continuation (when its context is on the true track) to a random depth,
    sometimes corrupted, plus random branches: bets hold, fail, and guess nothing, all at random."""

    name = "scripted"

    def __init__(self, truth: list[int], rng: random.Random, max_nodes: int, right: float):
        self.truth, self.rng, self.max_nodes, self.right = truth, rng, max_nodes, right

    def propose(self) -> TokenTree:
        ctx, rng = self.context, self.rng
        tree = TokenTree.root_only(ctx[-1])
        on_track = self.truth[: len(ctx)] == ctx
        if on_track and rng.random() < self.right:
            path = self.truth[len(ctx) : len(ctx) + rng.randrange(1, 7)]
            if path and rng.random() < 0.5:  # a decoy that leaves the truth somewhere, trusted more
                decoy = list(path)
                decoy[rng.randrange(len(decoy))] = rng.randrange(3, VOCAB)
                tree.add_path(decoy + [rng.randrange(3, VOCAB)], [0.95] * (len(decoy) + 1))
                tree.add_path(path, [0.5] * len(path))
            else:
                tree.add_path(path, [0.9] * len(path))
        while len(tree) < self.max_nodes and rng.random() < 0.7:
            tree.add(rng.randrange(len(tree)), rng.randrange(3, VOCAB), 0.2)
        return tree


def sequential(edge, prompt, n, sampling=None):
    out = []
    for new, _ in edge.generate_ids(
        GenerationRequest(prompt, n, stop_at_eos=False, spec=SpecConfig("none"), sampling=sampling)
    ):
        out.extend(new)
    return out


def pipelined(edge, prompt, n, drafter, sampling=None, max_nodes=None, eos=(), session=None, cached=0):
    stats = SpecStats()
    own = session is None
    session = session or edge.open_session()
    out = []
    try:
        for new in decode(
            session,
            DecodeRequest(
                prompt,
                n,
                set(eos),
                cached=cached,
                sampling=sampling,
                speculation=Speculation(
                    drafter, StepBudget(fixed_nodes=max_nodes), stats, pipeline=True, always_bet=True
                ),
            ),
        ):
            out.extend(new)
    finally:
        if own:
            session.close()
    return out, stats


def random_prompt(rng, length):
    base = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 6))]
    return [rng.choice(base) if rng.random() < 0.5 else rng.randrange(3, VOCAB) for _ in range(length)]


@pytest.mark.parametrize("seed", range(3))
def test_greedy_pipelined_equals_sequential(edge, seed):
    rng = random.Random(seed)
    totals = SpecStats()
    for right in (1.0, 0.6, 0.0):  # drafts right, partly right, wrong
        prompt = random_prompt(rng, rng.randrange(3, 16))
        n = rng.randrange(20, 40)
        reference = sequential(edge, prompt, n)
        for max_nodes in (3, 8):
            out, stats = pipelined(edge, prompt, n, Scripted(prompt + reference, rng, 12, right), max_nodes=max_nodes)
            assert out == reference, (right, max_nodes)
            totals.pipelined += stats.pipelined
            totals.discarded += stats.discarded
            totals.accepted_drafts += stats.accepted_drafts
    assert totals.accepted_drafts > 0
    assert 0 < totals.discarded < totals.pipelined  # bets that held and bets that failed both happened


class Learner(Scripted):
    """A scripted drafter that checks what it is told: each `verified` concerns its latest proposal,
    on the context it still holds, with the hidden states it asked for."""

    extras = 1

    def __init__(self, *args):
        super().__init__(*args)
        self.proposed: list[tuple[list[int], TokenTree]] = []  # (context, tree) of each proposal
        self.learned = 0

    def propose(self) -> TokenTree:
        tree = super().propose()
        self.proposed.append((list(self.context), tree))
        return tree

    def verified(self, tree, path, new, step) -> None:
        assert step.hidden is not None and step.topk is not None and len(step.hidden) == len(tree)
        if not self.proposed:  # the prefill: a root-only tree of the prompt's last token
            assert len(tree) == 1 and self.context[-1] == new[0]
            return
        ctx, mine = self.proposed[-1]
        assert self.context == ctx and tree.tokens[0] == ctx[-1]
        assert set(tree.paths()) <= set(mine.paths())  # what the budget kept of it
        assert new == self.truth[len(ctx) : len(ctx) + len(new)]  # greedy: the true continuation
        self.learned += 1


@pytest.mark.parametrize("seed", range(2))
def test_the_learning_drafter_learns_each_step_it_drafted_and_bets_go_to_the_other(edge, seed):
    rng = random.Random(40 + seed)
    prompt = random_prompt(rng, 10)
    reference = sequential(edge, prompt, 40)
    learner, better = Learner(prompt + reference, rng, 8, 0.9), Scripted(prompt + reference, rng, 8, 0.9)
    stats, session, out = SpecStats(), edge.open_session(), []
    try:
        for new in decode(
            session,
            DecodeRequest(
                prompt,
                40,
                set(),
                speculation=Speculation(
                    learner, StepBudget(fixed_nodes=6), stats, pipeline=True, bet_drafter=better, always_bet=True
                ),
            ),
        ):
            out.extend(new)
    finally:
        session.close()
    assert out == reference
    assert stats.pipelined > 0 and learner.learned == len(learner.proposed) - (stats.steps < len(learner.proposed))
    assert learner.learned + stats.pipelined - stats.discarded == stats.steps  # every step stood on one or the other


def test_stops_at_an_end_token_inside_a_pipelined_run(edge):
    rng = random.Random(7)
    prompt = random_prompt(rng, 9)
    reference = sequential(edge, prompt, 30)
    eos = reference[17]
    cut = reference[: reference.index(eos) + 1]
    out, _ = pipelined(edge, prompt, 30, Scripted(prompt + reference, rng, 10, 0.8), eos={eos})
    assert out == cut


@pytest.mark.parametrize("seed", range(2))
def test_seeded_sampling_pipelined_equals_sequential_sampling(edge, seed):
    rng = random.Random(100 + seed)
    prompt = random_prompt(rng, 8)
    cfg = SamplingConfig(temperature=0.8, top_p=0.95, seed=seed)
    reference = sequential(edge, prompt, 30, cfg)
    for right in (1.0, 0.5):
        out, stats = pipelined(edge, prompt, 30, Scripted(prompt + reference, rng, 10, right), cfg, max_nodes=6)
        assert out == reference
    assert stats.pipelined > 0


def cloud_cache(edge, session):
    return edge.server.server.sessions.sessions[session.link.id].cache


def test_caches_after_a_run_equal_a_recomputation(edge):
    rng = random.Random(3)
    prompt = random_prompt(rng, 10)
    reference = sequential(edge, prompt, 36)
    session = edge.open_session()
    fresh = edge.open_session()
    try:
        out, stats = pipelined(edge, prompt, 36, Scripted(prompt + reference, rng, 10, 0.6), session=session)
        assert out == reference and stats.discarded > 0
        context = prompt + out
        # one more step: the caches hold the context except its last token, as a fresh prefill's do
        logits = session.forward(StepInput([context[-1]])).out[-1]
        expected = fresh.forward(StepInput(context)).out[-1]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        for name in ("head_cache", "tail_cache"):
            a, b = getattr(session.layers, name), getattr(fresh.layers, name)
            assert a.length == b.length == len(context)
            assert a.positions.tolist() == b.positions.tolist()
            for layer in range(a.num_layers):  # (keys, values) of the entries in use
                torch.testing.assert_close(a.view(layer), b.view(layer), atol=1e-4, rtol=1e-4)
        a, b = cloud_cache(edge, session), cloud_cache(edge, fresh)
        assert a.length == b.length == len(context)
        for layer in range(a.num_layers):
            torch.testing.assert_close(a.view(layer), b.view(layer), atol=1e-4, rtol=1e-4)
    finally:
        session.close()
        fresh.close()


def test_two_forwards_in_flight_on_one_connection(edge):
    session = edge.open_session()
    sequential_session = edge.open_session()
    try:
        prompt = [5, 9, 11, 5, 9]
        session.forward(StepInput(prompt))
        sequential_session.forward(StepInput(prompt))
        first = session.send(StepInput([12], [5]))
        second = session.send(StepInput([13, 14], [6, 7]))  # sent before the first reply is taken
        assert len(session.link.client.in_flight) == 2
        with pytest.raises(Exception, match="order"):
            session.receive(second)
        a, b = session.receive(first).out, session.receive(second).out
        assert not session.link.client.in_flight
        torch.testing.assert_close(a, sequential_session.forward(StepInput([12])).out)
        torch.testing.assert_close(b, sequential_session.forward(StepInput([13, 14])).out)
    finally:
        session.close()
        sequential_session.close()


def test_sync_drafter_cuts_back_and_extends():
    d = Drafter()
    d.reset([1, 2, 3])
    sync_drafter(d, [1, 2, 3, 4])
    assert d.context == [1, 2, 3, 4]
    sync_drafter(d, [1, 2, 7])
    assert d.context == [1, 2, 7]


@pytest.mark.parametrize("mode", ["ngram", "auto"])
def test_generate_with_pipeline_equals_sequential(edge, mode):
    """Through the edge: two drafters of the mode, one learning, one betting (`auto`: its head too)."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    reference = sequential(edge, prompt, 24)
    out = []
    for new, live in edge.generate_ids(
        GenerationRequest(prompt, 24, stop_at_eos=False, spec=SpecConfig(mode, pipeline=True))
    ):
        out.extend(new)
        stats = live
    assert out == reference
    assert stats.spec_mode == f"{mode} pipelined"
    assert "pipelined_steps" in stats.to_dict()["spec"]


@pytest.mark.parametrize("stop_early", [None, 5, 9, 13, 17])
def test_a_later_turn_reuses_the_caches_a_pipelined_turn_left(edge, stop_early):
    """Turn 1 pipelined (ended by its length limit, or closed by the caller mid-run as a stop string
    does); turn 2 feeds only its new tokens on the same session and must equal a fresh sequential run."""
    rng = random.Random(11)
    prompt = random_prompt(rng, 8)
    reference = sequential(edge, prompt, 30)
    session = edge.open_session()
    try:
        steps = decode(
            session,
            DecodeRequest(
                prompt,
                30,
                set(),
                speculation=Speculation(
                    Scripted(prompt + reference, rng, 6, 0.9), StepBudget(), SpecStats(), pipeline=True, always_bet=True
                ),
            ),
        )
        first = []
        for new in steps:
            first.extend(new)
            if stop_early and len(first) >= stop_early:
                steps.close()
                break
        assert first == reference[: len(first)]
        follow = prompt + first + [5, 6, 7]
        expected = sequential(edge, follow, 16)
        cached = len(prompt) + len(first) - 1  # the caches hold the context except its last token
        second, _ = pipelined(
            edge, follow, 16, Scripted(follow + expected, rng, 10, 0.7), session=session, cached=cached
        )
        assert second == expected
    finally:
        session.close()


def test_split_head_and_sealed_pipelined_equal_sequential(tiny_split_head, split_head_server, tiny_split):
    """The split-head topology (no tail layers) and a sealed cache pipeline exactly too."""
    rng = random.Random(5)
    with Edge(tiny_split_head / "edge", split_head_server.url, EdgeConfig(wire_dtype="fp32")) as e:
        prompt = [rng.randrange(3, 200) for _ in range(9)]
        reference = sequential(e, prompt, 24)
        out, stats = pipelined(e, prompt, 24, Scripted(prompt + reference, rng, 8, 0.8))
        assert out == reference and stats.pipelined > 0
    with (
        BackgroundServer(tiny_split / "cloud") as server,
        Edge(tiny_split / "edge", server.url, EdgeConfig(wire_dtype="fp32", cache_policy="sealed")) as e,
    ):
        reference = sequential(e, prompt, 24)
        session = e.open_session()
        assert session.pipelines
        try:
            out, stats = pipelined(e, prompt, 24, Scripted(prompt + reference, rng, 8, 0.8), session=session)
        finally:
            session.close()
        assert out == reference and stats.discarded > 0


def test_window_policies_do_not_pipeline(edge):
    session = edge.open_session(cache_policy="window:64")
    try:
        assert not session.pipelines
        session.forward(StepInput([4, 5, 6]))
        session.send(StepInput([7], [3]))
        with pytest.raises(Exception, match="pipelined"):
            session.send(StepInput([8], [4]))
        session.receive(session.link.flights[0])
    finally:
        session.close()
    prompt = [9, 10, 9, 10, 9, 10, 9]  # generate falls back to one step at a time, same output
    session = edge.open_session(cache_policy="window:64")
    try:
        out = [
            t
            for new, _ in edge.generate_ids(
                GenerationRequest(prompt, 12, stop_at_eos=False, spec=SpecConfig("ngram", pipeline=True)), session
            )
            for t in new
        ]
    finally:
        session.close()
    assert out == sequential(edge, prompt, 12)
