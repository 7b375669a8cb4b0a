"""The white-box attack on the bundled model (SmolLM2-135M) at K=2, on a few held-out sequences."""

import pytest

from splitlm.audit.attacks import LinearProbe, merge_candidates, recovery, whitebox
from splitlm.audit.data import build_corpus, default_documents
from splitlm.audit.views import SplitView, batched


@pytest.mark.slow
def test_whitebox_reads_the_bundled_model_uplink():
    from splitlm.audit.run import load_for_audit

    model, encode, _ = load_for_audit("default")
    corpus = build_corpus(
        default_documents(), encode, model.cfg.vocab_size, seq_len=16, max_train_tokens=8192, max_eval_tokens=64
    )
    view = SplitView(model, 2, 2)
    probe = LinearProbe(batched(view.up, corpus.train).flatten(0, 1), corpus.train.flatten(), model.embed_tokens.weight)
    truth = corpus.held_out  # [4, 16]
    up = batched(view.up, truth)
    probe_ranked = probe.rank(up.flatten(0, 1), 32)
    cands = merge_candidates([probe_ranked], corpus.frequent(32), 32, truth.numel())
    r = recovery(whitebox(view.public_head, view.embed, up, cands.view(*truth.shape, -1)), truth)
    assert r["top1"] >= 0.9
    assert r["top1"] >= recovery(probe_ranked[:, :5].view(*truth.shape, 5), truth)["top1"]
