"""Each attack on a tiny random model (byte-level tokens) built in code."""

import pytest
import torch

from splitlm.audit.attacks import (
    LinearProbe,
    merge_candidates,
    rank_lens,
    rank_nn,
    recovery,
    train_mlp_probe,
    whitebox,
)
from splitlm.audit.data import build_corpus
from splitlm.audit.views import SplitView, batched


@pytest.fixture(scope="module")
def corpus(audit_model, audit_docs):
    model, encode = audit_model
    return build_corpus(
        audit_docs, encode, model.cfg.vocab_size, seq_len=16, max_train_tokens=4096, max_eval_tokens=256
    )


def test_corpus_splits_by_document():
    docs = [chr(65 + i) * (20 + i) for i in range(10)]  # document i: one letter, repeated
    c = build_corpus(docs, lambda s: list(s.encode()), 256, seq_len=8, max_train_tokens=10_000, max_eval_tokens=10_000)
    assert (c.train_docs, c.held_out_docs) == (9, 1)
    assert c.held_out.shape[1] == c.train.shape[1] == 8
    held_letters = set(c.held_out.flatten().tolist())
    assert len(held_letters) == 1 and not held_letters & set(c.train.flatten().tolist())
    assert int(c.counts[65:75].sum()) == sum(20 + i for i in range(10)) - len(docs[next(iter(held_letters)) - 65])
    assert c.frequent(1).item() in set(c.train.flatten().tolist())


def test_nn_and_lens_rank_the_obvious_answer_first(audit_model):
    model, _ = audit_model
    emb = model.embed_tokens.weight
    ids = torch.arange(0, 256, 7)
    noisy = emb[ids] + 0.01 * emb[ids].norm(dim=-1, keepdim=True) * torch.randn(len(ids), emb.shape[1]) / 8
    assert (rank_nn(noisy, emb, 5)[:, 0] == ids).all()
    # the lens on the last layer's output is the model's own next-token argmax
    x = torch.randint(0, 256, (2, 12))
    h = model.stack(model.embed_tokens(x), torch.arange(12))  # [2, 12, D]
    full = model(x, torch.arange(12))
    assert torch.equal(rank_lens(h.flatten(0, 1), model, 3)[:, 0], full.argmax(-1).flatten())


def test_probes_beat_the_frequency_baseline(audit_model, corpus):
    model, _ = audit_model
    view = SplitView(model, 1, 2)
    h_train = batched(view.up, corpus.train).flatten(0, 1)
    h_eval = batched(view.up, corpus.held_out)
    truth = corpus.held_out
    base = recovery(corpus.frequent(5).expand(*truth.shape, 5), truth)["top1"]
    linear = LinearProbe(h_train, corpus.train.flatten(), model.embed_tokens.weight)
    mlp = train_mlp_probe(h_train, corpus.train.flatten(), model.embed_tokens.weight, epochs=2)
    lin = recovery(linear.rank(h_eval.flatten(0, 1), 5).view(*truth.shape, 5), truth)
    mlp_r = recovery(mlp.rank(h_eval.flatten(0, 1), 5).view(*truth.shape, 5), truth)
    assert lin["top1"] > 0.8 and lin["top1"] > base + 0.5
    assert mlp_r["top1"] > base + 0.3
    assert set(mlp.rank(h_eval.flatten(0, 1), 5).unique().tolist()) <= set(corpus.train.unique().tolist())


def test_whitebox_recovers_an_undefended_tiny_model(audit_model, corpus):
    model, _ = audit_model
    view = SplitView(model, 2, 2)
    truth = corpus.held_out[:8]  # [8, 16]
    up = batched(view.up, truth)
    # candidates from the cheap attacks: the truth is not handed to the search
    h_train = batched(view.up, corpus.train).flatten(0, 1)
    probe = LinearProbe(h_train, corpus.train.flatten(), model.embed_tokens.weight)
    cands = merge_candidates(
        [probe.rank(up.flatten(0, 1), 48), rank_lens(up.flatten(0, 1), model, 48)],
        corpus.frequent(48),
        48,
        truth.numel(),
    )  # 48 of the 256 tokens per position
    ranked = whitebox(view.public_head, view.embed, up, cands.view(8, 16, -1))
    r = recovery(ranked, truth)
    assert r["top1"] >= 0.95
    assert r["top1"] > recovery(probe.rank(up.flatten(0, 1), 5).view(8, 16, 5), truth)["top1"]


def test_whitebox_search_is_exact_with_every_token_as_candidate(audit_model):
    model, _ = audit_model
    view = SplitView(model, 2, 2)
    truth = torch.randint(0, 256, (2, 10))
    everything = torch.arange(256).expand(2, 10, 256)
    r = recovery(whitebox(view.public_head, view.embed, batched(view.up, truth), everything), truth)
    assert r["top1"] == r["exact_seq"] == 1.0


def test_merge_candidates_interleaves_deduplicates_and_fills():
    a = torch.tensor([[5, 6, 7]])
    b = torch.tensor([[6, 9, 5]])
    out = merge_candidates([a, b], torch.tensor([1, 5, 2, 3]), 6, 1)
    assert out.tolist() == [[5, 6, 9, 7, 1, 2]]
    assert merge_candidates([], torch.tensor([4, 3, 2]), 2, 3).tolist() == [[4, 3]] * 3
