"""Property tests: every drafter, tree shape and window size gives sequential greedy output exactly."""

import random

import pytest
import torch

from conftest import make_tiny_llama
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.drafters import Drafter, LookaheadDrafter, NgramDrafter
from splitlm.decoding.local import LocalSession
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.step import StepInput
from splitlm.decoding.tree import TokenTree, accept_greedy
from splitlm.model.loading import load_model


@pytest.fixture(scope="module", params=[0, 1])
def model(request, tmp_path_factory):
    path = make_tiny_llama(
        tmp_path_factory.mktemp(f"spec-{request.param}"), seed=10 + request.param, vocab_size=64
    )  # a small vocabulary: greedy text repeats, drafts get accepted
    return load_model(path)[0]


def run(model, prompt, n, drafter, max_nodes=None):
    stats = SpecStats()
    out = []
    for new in decode(
        LocalSession(model),
        DecodeRequest(prompt, n, set(), speculation=Speculation(drafter, StepBudget(fixed_nodes=max_nodes), stats)),
    ):
        out.extend(new)
    return out, stats


def random_prompt(rng, length):
    base = [rng.randrange(3, 64) for _ in range(rng.randrange(2, 6))]
    return [rng.choice(base) if rng.random() < 0.5 else rng.randrange(3, 64) for _ in range(length)]


class NoisyOracle(Drafter):
    """Proposes the true continuation up to a random depth, corrupted somewhere, plus random branches."""

    name = "oracle"

    def __init__(self, reference, prompt_len, rng, max_nodes):
        self.reference, self.prompt_len, self.rng, self.max_nodes = reference, prompt_len, rng, max_nodes

    def propose(self):
        done = len(self.context) - self.prompt_len  # generated so far (root included)
        truth = self.reference[done : done + self.rng.randrange(0, 8)]
        if truth and self.rng.random() < 0.5:
            truth[self.rng.randrange(len(truth))] = self.rng.randrange(3, 64)
        tree = TokenTree.root_only(self.context[-1])
        tree.add_path(truth, [0.9] * len(truth))
        while len(tree) < self.max_nodes:
            tree.add(self.rng.randrange(len(tree)), self.rng.randrange(3, 64), 0.1)
        return tree


def test_greedy_acceptance_walks_the_tree():
    tree = TokenTree([5, 7, 8, 9], [-1, 0, 0, 1], [1, 0.5, 0.5, 0.4])
    assert accept_greedy(tree, [7, 1, 2, 3]) == ([0, 1], [7, 1])
    assert accept_greedy(tree, [7, 9, 2, 4]) == ([0, 1, 3], [7, 9, 4])
    assert accept_greedy(tree, [6, 0, 0, 0]) == ([0], [6])
    m = tree.mask()
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


def test_pruning_keeps_parents():
    tree = TokenTree([1, 2, 3, 4, 5], [-1, 0, 1, 0, 3], [1, 0.9, 0.8, 0.2, 0.85])
    small = tree.pruned(3)
    assert len(small) == 3 and small.tokens == [1, 2, 3]
    for i, p in enumerate(small.parents):
        assert p < i


@pytest.mark.parametrize("seed", range(4))
def test_noisy_trees_match_sequential(model, seed):
    rng = random.Random(seed)
    prompt = random_prompt(rng, rng.randrange(3, 20))
    reference, _ = run(model, prompt, 40, Drafter())
    for max_nodes in (2, 5, 12):
        out, stats = run(model, prompt, 40, NoisyOracle(reference, len(prompt), rng, max_nodes), max_nodes)
        assert out == reference
        lengths = {c for c in stats.choices}
        assert lengths  # steps were taken
    # accepted path lengths vary from 0 to long with the oracle
    _, stats = run(model, prompt, 40, NoisyOracle(reference, len(prompt), random.Random(99), 6), 6)
    assert stats.accepted_drafts > 0 and stats.steps < 40


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", ["ngram", "lookahead", "auto-window", "auto"])
def test_drafters_match_sequential(model, seed, mode):
    rng = random.Random(seed)
    prompt = random_prompt(rng, rng.randrange(4, 30))
    reference, _ = run(model, prompt, 48, Drafter())
    out, stats = run(model, prompt, 48, make_drafter(SpecConfig(mode)))  # auto-window's window adapts
    assert out == reference
    assert stats.steps <= 47


@pytest.mark.parametrize("width,ngram", [(1, 2), (3, 3), (6, 5), (2, 4)])
def test_lookahead_windows_of_any_size(model, width, ngram):
    prompt = random_prompt(random.Random(width * 10 + ngram), 12)
    reference, _ = run(model, prompt, 40, Drafter())
    out, stats = run(model, prompt, 40, LookaheadDrafter(width=width, ngram=ngram), max_nodes=8)
    assert out == reference
    assert stats.window_tokens == stats.steps * width * (ngram - 1)


def test_ngram_tree_has_branches():
    d = NgramDrafter(max_n=2, max_depth=3)
    d.reset([1, 2, 3, 9, 1, 2, 4, 8, 1, 2])
    tree = d.propose()
    # the suffix (1, 2) was followed by 3 and by 4: two branches under the root
    assert sorted(tree.tokens[i] for i in range(1, len(tree)) if tree.parents[i] == 0) == [3, 4]
    assert all(
        tree.scores[i] <= tree.scores[max(tree.parents[i], 0)] or tree.parents[i] == 0 for i in range(1, len(tree))
    )


def test_keep_after_partial_acceptance_equals_recompute(model):
    prompt = [5, 6, 7, 8]
    sess = LocalSession(model)
    sess.forward(StepInput(prompt))
    tree = TokenTree([9, 10, 11, 12, 13], [-1, 0, 0, 1, 3], [1, 0.5, 0.5, 0.4, 0.3])
    mask = tree.mask()
    positions = [len(prompt) + d for d in tree.depths()]
    sess.forward(StepInput(tree.tokens, positions, mask))
    logits = sess.forward(StepInput([20], [len(prompt) + 3], keep=[0, 1, 3])).out[-1]
    with torch.no_grad():
        ref = model(torch.tensor([prompt + [9, 10, 12, 20]]), torch.arange(8))[0, -1]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_adaptive_window_follows_its_measured_gain():
    budget = StepBudget(rtt_prior_s=0.08)
    for t in (1, 5, 20, 40):  # 3 ms per token, 50 ms per step
        budget.observe_step(t, 0.05 + 0.003 * t, 0.08)
    # a 4-column window of 3 levels costs 36 ms a step; a pool that adds nothing shrinks it
    assert budget.window_width(4, 8, 3, gain_tokens=0.0, tokens_per_step=1.5) == 3
    assert budget.window_width(1, 8, 3, gain_tokens=0.0, tokens_per_step=1.5) == 0  # switched off
    assert budget.window_width(0, 8, 3, gain_tokens=0.0, tokens_per_step=1.5) == 0
    assert budget.window_width(0, 8, 3, gain_tokens=1.0, tokens_per_step=1.5) == 1  # its pool still pays
    # a pool that adds a token per step (worth ~100 ms) grows it
    assert budget.window_width(4, 8, 3, gain_tokens=1.0, tokens_per_step=1.5) == 5
    cheap = StepBudget()
    for t in (1, 5, 20, 40):  # compute is nearly free next to an 80 ms round trip
        cheap.observe_step(t, 0.002, 0.08)
    assert cheap.window_width(2, 8, 3, gain_tokens=0.0, tokens_per_step=1.0) == 8
    assert cheap.choose(TokenTree([1, 2, 3], [-1, 0, 1], [1, 0.9, 0.8])).nodes == 3


def test_corpus_drafter_matches_sequential(model):
    from splitlm.decoding.corpus import CorpusDrafter, NgramModel

    rng = random.Random(5)
    corpus = NgramModel([rng.randrange(3, 64) for _ in range(3000)])
    prompt = random_prompt(rng, 10)
    reference, _ = run(model, prompt, 40, Drafter())
    for mix in (False, True):
        out, stats = run(model, prompt, 40, CorpusDrafter(corpus, mix_context=mix), max_nodes=10)
        assert out == reference
        assert stats.tree_nodes > stats.steps  # it did draft


def test_ngram_model_backs_off_to_shorter_contexts():
    from splitlm.decoding.corpus import NgramModel

    m = NgramModel([1, 2, 3, 1, 2, 3, 1, 2, 4, 9, 2, 3], max_n=2, min_count=1)
    assert m.next_tokens([1, 2], 2)[0] == (3, 2 / 3)
    assert m.next_tokens([7, 2], 1) == [(3, 0.75)]  # (7, 2) unseen -> order 1
    assert m.next_tokens([5], 1) == []
