"""The split-head topology end to end over a real loopback WebSocket, against transformers."""

import pytest
import torch

from conftest import BUNDLED_PROMPTS, hf_greedy
from splitlm.decoding.step import StepInput
from splitlm.edge import Edge, EdgeConfig
from splitlm.model.shards import split_model


def hf_masked_greedy(model, ids: list[int], n: int, allowed: list[int]) -> list[int]:
    """The oracle for a vocabulary subset: the full model's greedy choice among `allowed` ids."""
    allowed_t = torch.tensor(allowed)
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([out])).logits[0, -1]
            out.append(int(allowed_t[logits[allowed_t].argmax()]))
    return out[len(ids) :]


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


PROMPTS = [[5, 6, 7], [10, 20, 30, 40, 50, 10, 20, 30]]


@pytest.mark.parametrize("spec", ["none", "ngram", "lookahead", "auto"])
def test_fp32_all_is_token_identical_to_transformers(tiny_split_head, split_head_server, tiny_hf, spec):
    with Edge(tiny_split_head / "edge", split_head_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        for ids in PROMPTS:
            result = edge.generate(ids, max_new_tokens=24, stop_at_eos=False, spec=spec)
            assert result.token_ids == hf_greedy(tiny_hf, ids, 24), (spec, ids)
            if spec == "none":
                assert result.stats.round_trips == 24


@pytest.mark.parametrize("policy", ["none", "sealed"])
def test_cache_policies_keep_the_output(tiny_split_head, split_head_server, tiny_hf, policy):
    ids = PROMPTS[1]
    with Edge(
        tiny_split_head / "edge", split_head_server.url, EdgeConfig(wire_dtype="fp32", cache_policy=policy)
    ) as edge:
        for spec in ("none", "lookahead"):
            result = edge.generate(ids, max_new_tokens=16, stop_at_eos=False, spec=spec)
            assert result.token_ids == hf_greedy(tiny_hf, ids, 16), (policy, spec)


def test_window_policy_matches_tail_local_topology(tiny_llama, tiny_split_head, split_head_server, tmp_path):
    """Under window:N the cloud's layers see only the last N positions (approximate output): the
    split-head output equals a tail-local split with the same cloud layers [K, L) and window."""
    from splitlm.cloud.server import BackgroundServer

    tail_local = split_model(str(tiny_llama), head=2, tail=0, out=tmp_path / "tl")
    with (
        BackgroundServer(tail_local / "cloud") as server,
        Edge(tail_local / "edge", server.url, EdgeConfig(wire_dtype="fp32", cache_policy="window:6")) as a,
        Edge(
            tiny_split_head / "edge", split_head_server.url, EdgeConfig(wire_dtype="fp32", cache_policy="window:6")
        ) as b,
    ):
        assert (
            a.generate(PROMPTS[1], 16, stop_at_eos=False).token_ids
            == b.generate(PROMPTS[1], 16, stop_at_eos=False).token_ids
        )


@pytest.mark.parametrize("topology", ["split-head", "tail-local"])
def test_vocabulary_subset_follows_the_masked_oracle(
    tiny_split_head, split_head_server, tiny_split, tiny_hf, tmp_path, topology
):
    from splitlm.cloud.server import BackgroundServer

    allowed = list(range(3, 256, 3))  # every third id
    allow_file = tmp_path / "allow.txt"
    allow_file.write_text(" ".join(map(str, allowed)))
    expected_allowed = sorted({*allowed, 2})  # + eos, always allowed
    split = tiny_split_head if topology == "split-head" else tiny_split
    with (
        BackgroundServer(split / "cloud") as server,
        Edge(split / "edge", server.url, EdgeConfig(wire_dtype="fp32", vocab=str(allow_file))) as edge,
    ):
        for spec in ("none", "lookahead"):
            result = edge.generate(PROMPTS[0], max_new_tokens=12, stop_at_eos=False, spec=spec)
            assert result.token_ids == hf_masked_greedy(tiny_hf, PROMPTS[0], 12, expected_allowed)
            assert set(result.token_ids) <= set(expected_allowed)


def test_split_head_downlink_shrinks_with_the_subset(tiny_split_head, split_head_server, tmp_path):
    allow_file = tmp_path / "allow.txt"
    allow_file.write_text(" ".join(map(str, range(0, 64))))
    down = {}
    for vocab in ("all", str(allow_file)):
        with Edge(tiny_split_head / "edge", split_head_server.url, EdgeConfig(wire_dtype="fp32", vocab=vocab)) as edge:
            s = edge.generate(PROMPTS[0], max_new_tokens=9, stop_at_eos=False).stats
            down[vocab] = s.bytes_down / s.round_trips
    # one row per round trip: h[:24] plus the allowed partial logits, fp32
    assert down["all"] - down[str(allow_file)] == pytest.approx((256 - 64) * 4, abs=8)


@pytest.mark.parametrize("wire", ["fp16", "int8", "fp8"])
def test_reduced_wire_codecs_decode(tiny_split_head, split_head_server, tiny_hf, wire):
    with Edge(tiny_split_head / "edge", split_head_server.url, EdgeConfig(wire_dtype=wire)) as edge:
        session = edge.open_session()
        try:
            ids = PROMPTS[1]
            logits = session.forward(StepInput(ids)).out
        finally:
            session.close()
    with torch.no_grad():
        expected = tiny_hf(torch.tensor([ids])).logits[0]
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean()
    assert logits.shape == expected.shape and agree >= 0.75


@pytest.fixture(scope="module")
def bundled_split_head(bundled_dir, tmp_path_factory):
    return split_model(
        "default", head=2, tail=0, out=tmp_path_factory.mktemp("bundled-split-head"), topology="split-head"
    )


@pytest.mark.slow
def test_bundled_model_split_head(bundled_split_head, bundled_hf):
    """fp32 wire, vocabulary `all`: token-identical to transformers; `en`: agreement on English prompts."""
    from splitlm.cloud.server import BackgroundServer

    hf, tok = bundled_hf
    split = bundled_split_head
    with BackgroundServer(split / "cloud") as server:
        with Edge(split / "edge", server.url, EdgeConfig(wire_dtype="fp32")) as edge:
            for prompt in BUNDLED_PROMPTS:
                ids = tok(prompt).input_ids
                assert edge.generate(prompt, max_new_tokens=24).token_ids == hf_greedy(hf, ids, 24), prompt
            ids = tok(BUNDLED_PROMPTS[1]).input_ids
            assert edge.generate(ids, max_new_tokens=24, spec="auto").token_ids == hf_greedy(hf, ids, 24)
        same = total = 0
        with Edge(split / "edge", server.url, EdgeConfig(wire_dtype="fp16", vocab="en")) as edge:
            for prompt in BUNDLED_PROMPTS:
                ids = tok(prompt).input_ids
                got, want = edge.generate(prompt, max_new_tokens=24).token_ids, hf_greedy(hf, ids, 24)
                n = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
                )
                same, total = same + n, total + len(want)
                assert all(edge.vocab.allowed[t] for t in got)
    print(f"\nsplit-head, vocab en, fp16 wire: greedy prefix agreement {same}/{total} = {same / total:.3f}")
    assert same / total >= 0.9


def test_many_rows_of_logits_go_in_chunks_under_the_frame_limit(tiny_split_head, tiny_hf):
    from splitlm.cloud.server import BackgroundServer
    from splitlm.cloud.sessions import ServerLimits

    ids = list(range(3, 19))  # 16 tokens; a RESULT of 16 KiB holds 10 rows of 24 + 256 fp32 values
    with (
        BackgroundServer(tiny_split_head / "cloud", limits=ServerLimits(max_frame_bytes=16 * 1024)) as server,
        Edge(tiny_split_head / "edge", server.url, EdgeConfig(wire_dtype="fp32")) as edge,
    ):
        assert edge.backend.max_logit_rows == 10
        session = edge.open_session()
        try:
            logits = session.forward(StepInput(ids)).out
            assert session.stats.round_trips == 2
        finally:
            session.close()
    with torch.no_grad():
        expected = tiny_hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_bundled_conversation_in_split_head(bundled_split_head, bundled_hf):
    """A second chat turn reuses the sealed cache and equals the full model run from scratch."""
    from splitlm.cloud.server import BackgroundServer

    hf, tok = bundled_hf
    turns = ["Name one planet of the solar system.", "What colour is it?"]
    with (
        BackgroundServer(bundled_split_head / "cloud") as server,
        Edge(bundled_split_head / "edge", server.url, EdgeConfig(wire_dtype="fp32", cache_policy="sealed")) as edge,
    ):
        chat = edge.conversation(spec="auto")
        first = chat.say(turns[0], max_new_tokens=16)
        second = chat.say(turns[1], max_new_tokens=16)
        chat.close()
    messages = [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": turns[1]},
    ]
    ids = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids
    assert second.prompt_ids == ids and second.stats.cached_tokens > 0
    assert second.token_ids == hf_greedy(hf, ids, 16)
