"""Exact speculative sampling: tree verification leaves the target distribution unchanged."""

from dataclasses import replace

import torch

from conftest import make_tiny_llama
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.local import LocalSession
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.sampling import Sampler, SamplingConfig, sample_token, token_distribution
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.tree import TokenTree, accept_sampled
from splitlm.model.loading import load_model


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_accept_sampled_matches_the_target_at_every_depth():
    """Root with three drafted children (one of them improbable, one impossible under top-k), one grandchild."""
    torch.manual_seed(0)
    v = 8
    logits = torch.randn(5, v) * 1.5  # [nodes, V]: the target after each node's path
    tree = TokenTree([0, 3, 5, 1, 2], [-1, 0, 0, 0, 1], [1.0, 0.5, 0.3, 0.1, 0.4])
    cfg = SamplingConfig(temperature=1.0, top_k=6)
    n = 20000
    first = torch.zeros(v)
    second_after_3 = torch.zeros(v)
    for seed in range(n):
        path, tokens = accept_sampled(tree, logits, Sampler(replace(cfg, seed=seed)), [7, 0])
        assert path[0] == 0 and len(tokens) == len(path)
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:], strict=False))
        first[tokens[0]] += 1
        if tokens[0] == 3:
            second_after_3[tokens[1]] += 1
    p_first = token_distribution(logits[0], cfg, [7, 0])
    p_second = token_distribution(logits[1], cfg, [7, 0, 3])
    assert tv(first, p_first) < 0.02, (first / n, p_first)
    assert second_after_3.sum() > 1000 and tv(second_after_3, p_second) < 0.04


def test_repetition_penalty_is_part_of_the_target():
    logits = torch.tensor([2.0, 1.0, -1.0, 0.5])
    cfg = SamplingConfig(temperature=1.0, repetition_penalty=2.0)
    p = token_distribution(logits, cfg, [0, 2])
    expected = torch.softmax(torch.tensor([1.0, 1.0, -2.0, 0.5]), -1)
    assert torch.allclose(p, expected)
    assert sample_token(logits, SamplingConfig(repetition_penalty=3.0), None, [0]) == 1  # greedy, penalised


class FixedTreeDrafter(Drafter):
    """Always the same three guesses after the root, one of them with a child: every step verifies a tree."""

    def __init__(self, guesses: list[int]):
        self.guesses = guesses

    def propose(self) -> TokenTree:
        tree = TokenTree.root_only(self.context[-1])
        for i, g in enumerate(self.guesses):
            node = tree.add(0, g, 0.5 - 0.1 * i)
        tree.add(node, self.guesses[0], 0.3)
        return tree


def run_once(model, prompt, guesses, cfg) -> list[int]:
    steps = decode(
        LocalSession(model),
        DecodeRequest(
            prompt,
            2,
            set(),
            sampling=cfg,
            speculation=Speculation(FixedTreeDrafter(guesses), StepBudget(fixed_nodes=5), SpecStats()),
        ),
    )
    return [t for step in steps for t in step]


def test_speculative_sampling_end_to_end_matches_plain_sampling(tmp_path):
    """Many seeded runs on a tiny model: the token after the first verified tree has the model's distribution."""
    model = load_model(make_tiny_llama(tmp_path / "m", seed=3, vocab_size=16))[0]
    prompt = [4, 5, 6, 4, 5]
    cfg0 = SamplingConfig(temperature=3.0, top_p=0.95)

    def target(ctx):
        with torch.no_grad():
            return token_distribution(model(torch.tensor([ctx]), torch.arange(len(ctx)))[0, -1], cfg0, ctx)

    p1 = target(prompt)
    first_token = int(p1.argmax())
    p2 = target(prompt + [first_token])
    guesses = torch.argsort(p2, descending=True)[[0, 2, 5]].tolist()  # a likely, a middling and a rare guess
    counts1, counts2 = torch.zeros(16), torch.zeros(16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny forwards: threads only add overhead
    try:
        runs = [run_once(model, prompt, guesses, replace(cfg0, seed=seed)) for seed in range(3000)]
    finally:
        torch.set_num_threads(threads)
    for out in runs:
        counts1[out[0]] += 1
        counts2[out[1]] += 1
    p2 = sum(p1[x] * target(prompt + [x]) for x in range(16))  # the second token's marginal
    print(
        f"\nTV first token {tv(counts1, p1):.3f} over {int(counts1.sum())}, "
        f"after the tree {tv(counts2, p2):.3f} over {int(counts2.sum())}"
    )
    assert tv(counts1, p1) < 0.05
    assert tv(counts2, p2) < 0.05


def test_greedy_with_sampling_config_stays_token_identical(tmp_path):
    model = load_model(make_tiny_llama(tmp_path / "m", seed=5, vocab_size=48))[0]
    prompt = [3, 4, 5, 3, 4, 5, 3]
    ref = list(
        decode(
            LocalSession(model),
            DecodeRequest(
                prompt, 20, set(), speculation=Speculation(make_drafter(SpecConfig("none")), StepBudget(), SpecStats())
            ),
        )
    )
    out = list(
        decode(
            LocalSession(model),
            DecodeRequest(
                prompt,
                20,
                set(),
                sampling=SamplingConfig(seed=1),
                speculation=Speculation(make_drafter(SpecConfig("ngram")), StepBudget(), SpecStats()),
            ),
        )
    )
    assert [t for s in out for t in s] == [t for s in ref for t in s]


def test_same_seed_same_tokens_as_sequential_sampling_whatever_the_drafter(tmp_path):
    """The randomness is fixed per position, so trees change the round trips, never the tokens."""
    from splitlm.decoding.modes import make_drafter

    model = load_model(make_tiny_llama(tmp_path / "m", seed=6, vocab_size=24))[0]
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    for seed in range(5):
        cfg = SamplingConfig(temperature=1.3, top_p=0.95, repetition_penalty=1.1, seed=seed)
        ref = [t for s in decode(LocalSession(model), DecodeRequest(prompt, 24, set(), sampling=cfg)) for t in s]
        for mode in ("ngram", "lookahead"):
            stats = SpecStats()
            out = [
                t
                for s in decode(
                    LocalSession(model),
                    DecodeRequest(
                        prompt,
                        24,
                        set(),
                        sampling=cfg,
                        speculation=Speculation(make_drafter(SpecConfig(mode)), StepBudget(fixed_nodes=8), stats),
                    ),
                )
                for t in s
            ]
            assert out == ref, (seed, mode)
        fixed = [
            t
            for s in decode(
                LocalSession(model),
                DecodeRequest(
                    prompt,
                    24,
                    set(),
                    sampling=cfg,
                    speculation=Speculation(FixedTreeDrafter(ref[1:4]), StepBudget(fixed_nodes=5), SpecStats()),
                ),
            )
            for t in s
        ]
        assert fixed == ref
