"""Draft-model speculation: a separate small model and the edge's own layers; greedy stays exact."""

import json
import shutil

import torch

from conftest import make_tiny_llama, save_byte_tokenizer
from splitlm.cli import main
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.draft import ModelDraft, ModelDrafter, SelfDraft, load_adapter
from splitlm.decoding.local import LocalSession
from splitlm.decoding.speculative import SpecConfig, SpecStats, make_drafter, speculative_decode
from splitlm.decoding.train_draft import train_draft
from splitlm.edge import Edge
from splitlm.model.loading import load_model
from splitlm.model.shards import load_edge, split_model


def decode(model, prompt, drafter, n=32):
    stats = SpecStats()
    out = [t for s in speculative_decode(LocalSession(model), prompt, n, set(), drafter, StepBudget(fixed_nodes=12),
                                         stats) for t in s]
    return out, stats


def test_a_draft_model_keeps_greedy_exact_and_a_perfect_draft_is_always_accepted(tmp_path):
    target = load_model(make_tiny_llama(tmp_path / "t", seed=1, vocab_size=64))[0]
    other = load_model(make_tiny_llama(tmp_path / "d", seed=2, vocab_size=64, num_hidden_layers=2))[0]
    prompt = [3, 9, 4, 11, 5]
    ref, _ = decode(target, prompt, make_drafter(SpecConfig("none")))
    out, _ = decode(target, prompt, ModelDrafter(ModelDraft(other)))
    assert out == ref
    same, stats = decode(target, prompt, ModelDrafter(ModelDraft(target), min_prob=0.0))
    assert same == ref
    assert stats.accepted_drafts / stats.steps >= 3.5  # the target drafting for itself: long chains accepted


def test_self_draft_and_train_draft(tmp_path, tiny_llama, tiny_split):
    edge = load_edge(tiny_split / "edge")
    target = load_model(tiny_llama)[0]
    prompt = [7, 8, 9, 7, 8]
    ref, _ = decode(target, prompt, make_drafter(SpecConfig("none")))
    assert decode(target, prompt, ModelDrafter(SelfDraft(edge)))[0] == ref
    shard = split_model(str(tiny_llama), head=2, tail=2, out=tmp_path / "s")
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 256, (300,), generator=gen).tolist() for _ in range(12)]
    report = train_draft(str(tiny_llama), shard / "edge", max_tokens=2000, token_docs=docs, seq_len=64)
    adapter = load_adapter(shard / "edge")
    assert adapter is not None and adapter.shape == (65, 64)
    assert report["train_tokens"] >= 1000 and 0 <= report["top1_agreement_raw"] <= 1
    assert report["top1_agreement_adapter"] > report["top1_agreement_raw"]  # the adapter helps the draft
    assert decode(target, prompt, ModelDrafter(SelfDraft(load_edge(shard / "edge"), adapter)))[0] == ref


def test_spec_draft_through_the_cloud(tiny_split, tiny_server, capsys, tmp_path):
    with Edge(tiny_split / "edge", tiny_server.url, wire_dtype="fp32", cloud_key=tiny_server.fingerprint) as edge:
        ref = edge.generate([5, 6, 7, 5, 6], max_new_tokens=24, stop_at_eos=False, spec="none").token_ids
        out = edge.generate([5, 6, 7, 5, 6], max_new_tokens=24, stop_at_eos=False, spec="draft:self-raw")
    assert out.token_ids == ref and out.stats.spec_mode == "draft"
    # a draft model that does not exist: one error line naming it, exit status 1 (the edge needs a
    # tokenizer for a text prompt, so that the draft is what fails)
    edge = tmp_path / "edge"
    shutil.copytree(tiny_split / "edge", edge)
    save_byte_tokenizer(edge)
    missing = tiny_split / "missing-model"
    code = main(["generate", "--edge", str(edge), "--cloud", tiny_server.url, "--prompt", "x",
                 "--spec", "draft", "--draft", str(missing), "--json"])
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert code == 1 and captured.out == ""
    assert len(errors) == 1 and errors[0].startswith(f"splitlm: error: model not found: '{missing}'")


def test_sampling_with_a_draft_model_equals_sequential_sampling(tmp_path):
    from splitlm.decoding.sampling import SamplingConfig, sample_decode

    target = load_model(make_tiny_llama(tmp_path / "t", seed=1, vocab_size=64))[0]
    cfg = SamplingConfig(temperature=0.8, seed=4)
    prompt = [3, 9, 4, 11, 5]
    ref = [t for s in sample_decode(LocalSession(target), prompt, 20, set(), cfg) for t in s]
    out = [t for s in speculative_decode(LocalSession(target), prompt, 20, set(), ModelDrafter(ModelDraft(target)),
                                         StepBudget(fixed_nodes=8), SpecStats(), sampling=cfg) for t in s]
    assert out == ref
    assert json.dumps(ref)  # plain ints
    assert torch.tensor(ref).dtype == torch.long
