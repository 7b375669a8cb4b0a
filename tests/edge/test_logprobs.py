"""Logprobs of emitted tokens (`splitlm.decoding.logprobs`): the same with and without speculation,
equal to transformers' full model, sorted alternatives that hold the greedy token."""

import pytest
import torch

from splitlm.decoding.logprobs import LogprobRecorder
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.sampling import SamplingConfig
from splitlm.edge import Edge, EdgeConfig, GenerationRequest

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]


@pytest.fixture(scope="module")
def edge(tiny_split):
    from splitlm.cloud.server import BackgroundServer

    with (
        BackgroundServer(tiny_split / "cloud") as server,
        Edge(tiny_split / "edge", server.url, EdgeConfig(wire_dtype="fp32", cloud_key=server.fingerprint)) as e,
    ):
        yield e


def run(edge, spec, sampling=None, top=5, n=24):
    rec = LogprobRecorder(top)
    result = edge.generate(
        GenerationRequest(PROMPT, max_new_tokens=n, spec=spec, sampling=sampling, stop_at_eos=False, logprobs=rec)
    )
    assert result.logprobs == rec.tokens and len(rec.tokens) == len(result.token_ids)
    assert [t.token for t in rec.tokens] == result.token_ids
    return result


def test_greedy_logprobs_equal_sequential_and_transformers(edge, tiny_llama):
    from transformers import AutoModelForCausalLM

    sequential = run(edge, "none")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + sequential.token_ids])).logits[0, len(PROMPT) - 1 : -1]  # [n, V]
    expected = torch.log_softmax(logits, -1)
    for i, t in enumerate(sequential.logprobs):
        assert t.logprob == pytest.approx(float(expected[i, t.token]), abs=1e-4)
        values = [lp for _, lp in t.top]
        assert values == sorted(values, reverse=True) and len(values) == 5
        assert t.top[0][0] == t.token  # greedy: the chosen token is the likeliest
    fixed = [SpecConfig("ngram", max_nodes=8), SpecConfig("ngram", max_nodes=8, pipeline=True)]
    for spec in ["auto", *fixed]:
        spec_run = run(edge, spec)
        assert spec_run.token_ids == sequential.token_ids
        if spec in fixed:
            assert spec_run.stats.tokens_per_round_trip > 1.0  # speculation did verify drafts
        for a, b in zip(spec_run.logprobs, sequential.logprobs, strict=True):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_sampled_logprobs_are_the_models_distribution(edge):
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=7)
    plain = run(edge, "none", sampling, top=0)
    spec = run(edge, SpecConfig("ngram", max_nodes=8), sampling, top=0)
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.top == [] and a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.logprob <= 0.0


def test_pipelined_logprobs_follow_the_bets(edge):
    from splitlm.decoding.loop import decode
    from splitlm.decoding.request import DecodeRequest, Speculation

    sequential = run(edge, "none")
    rec = LogprobRecorder(3)
    spec = SpecConfig("ngram", max_nodes=8)
    drafter, _ = edge._drafter(spec)
    budget, _ = edge.drafting.budgets(spec).take()
    from splitlm.decoding.speculative import SpecStats

    stats = SpecStats()
    session = edge.open_session()
    try:
        out = [
            t
            for new in decode(
                session,
                DecodeRequest(
                    PROMPT,
                    24,
                    set(),
                    logprobs=rec,
                    speculation=Speculation(drafter, budget, stats, pipeline=True, always_bet=True),
                ),
            )
            for t in new
        ]
    finally:
        session.close()
    assert stats.pipelined > 0  # steps were sent on bets
    assert out == sequential.token_ids and [t.token for t in rec.tokens] == out
    for a, b in zip(rec.tokens, sequential.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
