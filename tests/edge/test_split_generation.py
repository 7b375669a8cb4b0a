"""The split system over a real loopback WebSocket against transformers' full model."""

import pytest
import torch

from conftest import BUNDLED_PROMPTS, hf_greedy
from splitlm.decoding.modes import SPEC_MODES
from splitlm.decoding.step import StepInput
from splitlm.edge import Edge, EdgeConfig

pytestmark = pytest.mark.slow


def test_fp32_split_is_token_identical_to_transformers(bundled_split, bundled_server, bundled_hf):
    hf, tok = bundled_hf
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        for prompt in BUNDLED_PROMPTS:
            ids = tok(prompt).input_ids
            result = edge.generate(prompt, max_new_tokens=64)
            expected = hf_greedy(hf, ids, 64)
            assert result.prompt_ids == ids
            assert result.token_ids == expected, prompt
            s = result.stats
            assert s.new_tokens == len(expected) and s.round_trips == len(expected)  # one per token
            assert s.tokens_per_round_trip == 1.0
            assert s.bytes_up > 0 and s.bytes_down > 0


def test_chat_prompt_uses_the_template(bundled_split, bundled_server, bundled_hf):
    hf, tok = bundled_hf
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        result = edge.generate("Name a fruit that is yellow.", max_new_tokens=24, chat=True)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Name a fruit that is yellow."}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False).input_ids
    assert result.prompt_ids == ids
    assert result.token_ids == hf_greedy(hf, ids, 24)


def teacher_forced_agreement(edge, hf, ids, n):
    continuation = hf_greedy(hf, ids, n)
    session = edge.open_session()
    try:
        logits = session.forward(StepInput(ids + continuation)).out  # one round trip
    finally:
        session.close()
    predicted = logits[len(ids) - 1 : len(ids) - 1 + len(continuation)].argmax(-1).tolist()
    return sum(p == c for p, c in zip(predicted, continuation, strict=True)), len(continuation)


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_reduced_precision_wire_agreement(bundled_split, bundled_server, bundled_hf, wire):
    hf, tok = bundled_hf
    hits = total = 0
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype=wire)) as edge:
        for prompt in BUNDLED_PROMPTS:
            h, n = teacher_forced_agreement(edge, hf, tok(prompt).input_ids, 64)
            hits, total = hits + h, total + n
    agreement = hits / total
    print(f"\n{wire} wire: teacher-forced agreement with transformers = {agreement:.4f} ({hits}/{total})")
    assert agreement >= 0.95


def test_stream_equals_generate(bundled_split, bundled_server):
    with Edge(bundled_split / "edge", bundled_server.url) as edge:
        stream = edge.stream("List three colours:", max_new_tokens=20)
        text = "".join(stream)
        assert text == stream.result.text
        assert stream.result.token_ids == edge.generate("List three colours:", max_new_tokens=20).token_ids


def test_edge_and_cloud_use_fresh_caches_per_session(bundled_split, bundled_server):
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        a = edge.generate([504, 3458, 282], max_new_tokens=10, stop_at_eos=False)
        b = edge.generate([504, 3458, 282], max_new_tokens=10, stop_at_eos=False)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 10
    assert torch.tensor(a.token_ids).numel() == 10


@pytest.mark.parametrize("mode", [m for m in SPEC_MODES if m != "none"])  # every drafter, `head` included
def test_speculative_split_is_token_identical(bundled_split, bundled_server, bundled_hf, mode):
    """Each drafter keeps the split token-identical and gets more than one token per round trip on
    repetitive code (on this machine, 64 tokens: 1.4 for lookahead to 2.9 for auto); `head` drafts with
    the head shipped for the bundled model."""
    hf, tok = bundled_hf
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    ids = tok(prompt).input_ids
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        result = edge.generate(prompt, max_new_tokens=64, spec=mode)
    assert result.token_ids == hf_greedy(hf, ids, 64)
    s = result.stats
    assert s.tokens_per_round_trip > 1, mode  # several tokens per round trip on repetitive code
    assert s.spec.steps == s.round_trips - 1


def test_a_draft_head_keeps_the_split_token_identical(bundled_split, bundled_server, bundled_hf):
    """An untrained head drafts badly but must not change a token; the edge learns only on its side."""
    from splitlm.decoding.head import DraftHead, HeadRunner
    from splitlm.decoding.modes import SpecConfig

    hf, tok = bundled_hf
    prompt = "The three primary colours are"
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        torch.manual_seed(0)
        w = edge.model.head_weight
        spec = SpecConfig("head")
        edge.drafting.draft_memory(spec).head = HeadRunner(
            DraftHead(edge.cfg.hidden_size, 64, torch.arange(0, 4096)), edge.model.embed_tokens.weight, w
        )
        result = edge.generate(prompt, max_new_tokens=24, spec=spec)
    assert result.token_ids == hf_greedy(hf, tok(prompt).input_ids, 24)
    assert result.stats.spec.steps == result.stats.round_trips - 1


def test_a_layer_head_reads_the_edge_s_features_and_keeps_the_split_token_identical(
    bundled_split, bundled_server, bundled_hf
):
    """The head that reads the edge's layers gets every verified row's three features from the edge's back
    end (the prefill's last rows too) and, untrained, must not change a token."""
    from splitlm.decoding.layer_drafter import LayerHeadRunner
    from splitlm.decoding.layer_head import LayerHead, LayerHeadShape
    from splitlm.decoding.modes import SpecConfig

    hf, tok = bundled_hf
    prompt = "The three primary colours are"
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        torch.manual_seed(0)
        cfg, spec = edge.cfg, SpecConfig("head")
        shape = LayerHeadShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 64)
        head = LayerHead(shape, torch.arange(0, 4096), edge.model.manifest.cloud_layers)
        runner = LayerHeadRunner(head, edge.model.embed_tokens.weight, edge.model.head_weight)
        edge.drafting.draft_memory(spec).head = runner
        seen = []
        append = runner.append
        runner.append = lambda ring, feats, *a: seen.append(feats.shape) or append(ring, feats, *a)
        result = edge.generate(prompt, max_new_tokens=24, spec=spec)
    ids = tok(prompt).input_ids
    assert result.token_ids == hf_greedy(hf, ids, 24)
    assert seen[0] == (len(ids), 3, cfg.hidden_size)  # the prefill's rows
    assert len(seen) == result.stats.round_trips and max(s[0] for s in seen[1:]) >= 1


def test_the_bundled_model_drafts_from_its_bundled_warmup_answers(bundled_split, bundled_server):
    from splitlm.decoding.corpus import default_corpus_documents
    from splitlm.decoding.warmup import BUNDLED_DIR

    with Edge(bundled_split / "edge", bundled_server.url) as edge:
        assert (BUNDLED_DIR / f"{edge.model.manifest.model_hash}.jsonl.gz").is_file()
        docs = edge.drafting.corpus_documents()
        pydoc = default_corpus_documents()
        assert docs[: len(pydoc)] == pydoc and len(docs) > len(pydoc) + 400
        assert any("```python" in d for d in docs[len(pydoc) :])


def test_pipelined_speculation_is_token_identical(bundled_split, bundled_server, bundled_hf, capsys):
    """Bets forced on every step (loopback has no RTT to pay for them), then `generate --pipeline`."""
    import json

    from splitlm.cli import main
    from splitlm.decoding.budget import StepBudget
    from splitlm.decoding.loop import decode
    from splitlm.decoding.modes import SpecConfig, make_drafter
    from splitlm.decoding.request import DecodeRequest, Speculation
    from splitlm.decoding.speculative import SpecStats

    hf, tok = bundled_hf
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    ids = tok(prompt).input_ids
    expected = hf_greedy(hf, ids, 48)
    with Edge(bundled_split / "edge", bundled_server.url, EdgeConfig(wire_dtype="fp32")) as edge:
        session, stats = edge.open_session(), SpecStats()
        try:
            drafter = make_drafter(SpecConfig("auto-window"), edge.drafting.corpus_model())
            out = [
                t
                for new in decode(
                    session,
                    DecodeRequest(
                        ids,
                        48,
                        set(edge.cfg.eos_token_ids),
                        speculation=Speculation(
                            drafter, StepBudget(fixed_nodes=10), stats, pipeline=True, always_bet=True
                        ),
                    ),
                )
                for t in new
            ]
        finally:
            session.close()
    assert out == expected
    assert stats.pipelined > 0 and stats.missed > 0  # bets placed, and rolled back on a miss
    assert (
        main(
            [
                "generate",
                "--edge",
                str(bundled_split / "edge"),
                "--cloud",
                bundled_server.url,
                "--prompt",
                prompt,
                "--max-new-tokens",
                "48",
                "--json",
                "--wire-dtype",
                "fp32",
                "--pipeline",
                "--no-chat",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == expected and result["stats"]["spec_mode"] == "auto pipelined"


def test_a_step_reports_the_edges_compute_apart_from_the_clouds(bundled_split, bundled_server):
    with Edge(bundled_split / "edge", bundled_server.url) as edge:
        session = edge.open_session()
        try:
            session.forward(StepInput(list(range(10, 40))))
            step = session.forward(StepInput([50, 51, 52, 53], argmax=True))  # after the prompt, a 4-token step
        finally:
            session.close()
    assert step.tokens == 4
    assert 0.0 < step.edge_s < step.compute_s  # the head, tail and LM head here; the cloud's 26 layers there
