"""Streamed, pipelined prefill: the same logits and tokens as one forward, and the chunk plan."""

import math
import random

import pytest
import torch

from conftest import hf_greedy
from splitlm import SplitLMError
from splitlm.decoding.step import StepInput
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.prefill import StageFit, Stages, candidates, plan, simulate, split

PROMPT = [random.Random(0).randrange(3, 250) for _ in range(100)]


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def prefill_logits(edge: Edge, ids: list[int], policy: str | None = None):
    """All rows' logits of one causal run of `ids`, and how it went up (None: in one forward)."""
    session = edge.open_session(policy)
    try:
        logits = session.forward(StepInput(ids)).out
        return logits, session.last_prefill, session.stats.round_trips
    finally:
        session.close()


@pytest.mark.parametrize("chunk", [32, 45])
def test_streamed_prefill_equals_one_forward(tiny_split, tiny_server, tiny_hf, chunk):
    url, edge_dir = tiny_server.url, tiny_split / "edge"
    with (
        Edge(edge_dir, url, EdgeConfig(wire_dtype="fp32", prefill_chunk=0)) as one,
        Edge(edge_dir, url, EdgeConfig(wire_dtype="fp32", prefill_chunk=chunk)) as streamed,
    ):
        expected, run, trips = prefill_logits(one, PROMPT)
        assert run is None and trips == 1
        logits, run, trips = prefill_logits(streamed, PROMPT)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        assert [c.tokens for c in run.chunks] == split(len(PROMPT), chunk) and trips == math.ceil(len(PROMPT) / chunk)
        assert all(c.bytes_up > 0 and c.bytes_down > 0 and c.cloud_s > 0 for c in run.chunks)
        want = hf_greedy(tiny_hf, PROMPT, 20)
        a = one.generate(PROMPT, max_new_tokens=20, stop_at_eos=False)
        b = streamed.generate(PROMPT, max_new_tokens=20, stop_at_eos=False, spec="auto")
        assert a.token_ids == b.token_ids == want
        assert b.stats.prefill_round_trips == trips and a.stats.prefill_round_trips == 1


def test_split_head_streams_rows_only_for_the_last_chunk(tiny_split_head, split_head_server, tiny_hf):
    url, edge_dir = split_head_server.url, tiny_split_head / "edge"
    with (
        Edge(edge_dir, url, EdgeConfig(wire_dtype="fp32", prefill_chunk=0)) as one,
        Edge(edge_dir, url, EdgeConfig(wire_dtype="fp32", prefill_chunk=40)) as streamed,
    ):
        expected, _, _ = prefill_logits(one, PROMPT)
        logits, run, _ = prefill_logits(streamed, PROMPT)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        assert len(run.chunks) == 3
        result = streamed.generate(PROMPT, max_new_tokens=16, stop_at_eos=False)
        assert result.token_ids == hf_greedy(tiny_hf, PROMPT, 16)
        run = None
        session = streamed.open_session()
        try:  # the greedy prefill asks for the last row only: the other chunks' replies carry no logits
            session.forward(StepInput(PROMPT, rows=[len(PROMPT) - 1], argmax=True))
            run = session.last_prefill
        finally:
            session.close()
        assert [c.bytes_down < c.bytes_up / 4 for c in run.chunks] == [True, True, False]


@pytest.mark.parametrize("policy", ["sealed", "none", "window:64"])
def test_policies(tiny_split, tiny_server, tiny_hf, policy):
    """sealed keeps the whole context, so it streams; none and window:N keep too little to stream."""
    with Edge(tiny_split / "edge", tiny_server.url, EdgeConfig(wire_dtype="fp32", prefill_chunk=32)) as edge:
        ids = PROMPT[:60] if policy.startswith("window") else PROMPT
        logits, run, _ = prefill_logits(edge, ids, policy)
        assert (run is not None) == (policy == "sealed")
        if policy != "window:64":
            with torch.no_grad():
                torch.testing.assert_close(logits, tiny_hf(torch.tensor([ids])).logits[0], rtol=1e-4, atol=1e-4)


def test_a_later_turn_streams_after_the_cached_history(tiny_split, tiny_server, tiny_hf):
    with Edge(tiny_split / "edge", tiny_server.url, EdgeConfig(wire_dtype="fp32", prefill_chunk=32)) as edge:
        session = edge.open_session()
        try:
            session.forward(StepInput(PROMPT[:30]))
            logits = session.forward(StepInput(PROMPT[30:])).out
            assert len(session.last_prefill.chunks) == 3
        finally:
            session.close()
    with torch.no_grad():
        torch.testing.assert_close(logits, tiny_hf(torch.tensor([PROMPT])).logits[0, 30:], rtol=1e-4, atol=1e-4)


def test_bad_prefill_chunk_is_refused(tiny_split, tiny_server):
    with pytest.raises(SplitLMError, match="prefill_chunk"):
        Edge(tiny_split / "edge", tiny_server.url, EdgeConfig(prefill_chunk="big"))


def test_bundled_model_streamed_is_token_identical(bundled_split, bundled_server, bundled_hf):
    hf, tok = bundled_hf
    from pydoc_data.topics import topics

    ids = tok(topics["assert"])["input_ids"][:300]
    expected = hf_greedy(hf, ids, 12)
    for chunk in (0, 64):
        with Edge(
            bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32", prefill_chunk=chunk)
        ) as edge:
            result = edge.generate(ids, max_new_tokens=12, stop_at_eos=False)
        assert result.token_ids == expected, chunk
        assert result.stats.prefill_round_trips == (1 if chunk == 0 else 5)


# -- the plan -------------------------------------------------------------------------------------


def stages(head=0.001, up=0.0, cloud=0.004, down=0.0, tail=0.001, fixed=0.0, per_past=0.0, rtt=0.08) -> Stages:
    return Stages(
        (fixed, head, per_past / 4),
        (0.0, up, 0.0),
        (fixed, cloud, per_past),
        (0.0, down, 0.0),
        (fixed, tail, per_past / 4),
        rtt,
    )


def test_one_chunk_runs_the_stages_one_after_another():
    st = stages(up=0.0002, down=0.0002, fixed=0.003, per_past=1e-5)
    n = 500
    assert simulate([n], st, 100) == pytest.approx(
        sum(st.t(s, n, 100) for s in (st.head, st.up, st.cloud, st.down, st.tail)) + st.rtt_s
    )


def test_streamed_takes_the_slowest_stage_plus_one_chunk_through_the_others():
    st = stages(up=0.0002, down=0.0002)  # the cloud is the slowest stage
    total, n = 2048, 64
    others = sum(st.t(s, n) for s in (st.head, st.up, st.down, st.tail))
    assert simulate(split(total, n), st) == pytest.approx(st.t(st.cloud, total) + others + st.rtt_s)
    st = stages(up=0.008, down=0.0002)  # a slow uplink
    others = sum(st.t(s, n) for s in (st.head, st.cloud, st.down, st.tail))
    assert simulate(split(total, n), st) == pytest.approx(st.t(st.up, total) + others + st.rtt_s)


def test_plan_streams_when_it_pays_and_sends_one_forward_when_not():
    p = plan(2048, 2048, stages(up=0.0002, down=0.0002, fixed=0.002))
    assert 32 <= p.chunk < 2048 and p.predicted_s < 0.8 * p.unchunked_s
    small = plan(40, 40, stages(fixed=0.05))  # the per-chunk cost outweighs any overlap
    assert small.chunk == 40 and small.predicted_s == small.unchunked_s
    capped = plan(2048, 100, stages(fixed=0.5))
    assert capped.chunk == 98 and capped.unchunked_s == math.inf  # 21 nearly equal chunks, the fewest allowed


def test_chunks_longer_than_a_cloud_pass_are_whole_passes():
    sizes = candidates(2048, 2048, 256)
    assert sizes[:5] == [2048, 1024, 768, 512, 256]
    assert all(n % 256 == 0 for n in sizes if n > 256) and 293 not in sizes and 2048 in sizes
    assert candidates(300, 300, 256)[0] == 300  # never beyond the prompt or the cap
    assert all(n <= 1000 for n in candidates(4096, 1000, 256))


def test_a_cost_per_cached_entry_makes_chunks_larger():
    free = plan(4096, 4096, stages(up=0.001, down=0.001, fixed=0.002))
    costly = plan(4096, 4096, stages(up=0.001, down=0.001, fixed=0.002, per_past=2e-5))
    assert costly.chunk > free.chunk
    assert simulate(split(4096, 32), stages(per_past=2e-5)) > simulate(split(4096, 512), stages(per_past=2e-5))


def test_stage_fit_recovers_the_costs():
    fit = StageFit((0.0, 0.0, 0.0))
    for n, past in [(1, 10), (1, 900), (64, 0), (300, 300), (128, 2000), (2, 3000), (512, 100)]:
        fit.add(n, past, 0.01 + 0.002 * n + 3e-5 * past)
    assert fit.coef[0] == pytest.approx(0.01, abs=2e-3)  # the priors (all 0 here) weigh a little
    assert fit.coef[1:] == pytest.approx((0.002, 3e-5), rel=0.05)
    assert fit.predict(100, 1000) == pytest.approx(0.01 + 0.2 + 0.03, rel=0.02)
