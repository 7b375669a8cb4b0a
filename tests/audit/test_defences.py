"""Defences on the tiny model: what they change and what they cost."""

import pytest
import torch

from splitlm import SplitLMError
from splitlm.audit.defences import Defence, parse_defence, parse_defences
from splitlm.audit.harden import HardenConfig, harden_head, head_state, relative_distance
from splitlm.audit.run import AuditConfig, run_audit
from splitlm.audit.views import SplitView, batched


def test_parse_defences():
    assert [d.name for d in parse_defences("none, noise:0.5,quant:4,harden,harden:7,none")] == [
        "none", "noise:0.5", "quant:4", "harden", "harden:7"]
    for bad in ("noise", "noise:-1", "quant:1", "quant:x", "blur:3", "harden:-2", "none:1"):
        with pytest.raises(SplitLMError, match="unknown defence"):
            parse_defence(bad)
    with pytest.raises(SplitLMError):
        parse_defences(" , ")


def test_noise_and_quantisation_change_the_uplink_as_specified():
    h = torch.randn(2, 50, 64) * 3
    noisy = Defence("noise", 0.5).apply(h, seed=1)
    rel = ((noisy - h).pow(2).mean(-1) / h.pow(2).mean(-1)).sqrt()
    assert abs(rel.mean().item() - 0.5) < 0.05
    assert torch.equal(noisy, Defence("noise", 0.5).apply(h, seed=1))
    q = Defence("quant", 4).apply(h)
    assert all(row.unique().numel() <= 15 for row in q.flatten(0, 1))  # 2**4 - 1 levels per token
    assert (q - h).abs().max() <= h.abs().amax(-1).max() / 7 / 2 + 1e-5
    assert torch.equal(Defence("none").apply(h), h)
    assert Defence("quant", 4).wire_bytes_per_token(64) == 34 and Defence("none").wire_bytes_per_token(64) == 128


def test_harden_moves_the_uplink_and_keeps_the_other_weights(audit_model, audit_docs):
    model, encode = audit_model
    from splitlm.audit.data import build_corpus

    corpus = build_corpus(audit_docs, encode, model.cfg.vocab_size, 16, 2048, 256)
    view = SplitView(model, 2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = harden_head(view, corpus.train, HardenConfig(steps=30, batch=4, lr=3e-3, margin=1.0))
    hard = SplitView(model, 2, 2, private_head=result.head)
    moved = relative_distance(batched(hard.up, corpus.held_out), batched(view.up, corpus.held_out)).mean()
    assert moved > 0.1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # public weights untouched
    names = set(head_state(result.head))
    assert names == {"model." + k[len("stack."):] for k in before if k.startswith(("stack.layers.0.", "stack.layers.1."))}


def test_audit_rows_and_a_defence_that_lowers_whitebox(audit_model, audit_docs):
    model, encode = audit_model
    config = AuditConfig(heads=[1, 2], tail=2, defences=parse_defences("none,noise:2"), seq_len=16,
                         max_train_tokens=4096, max_eval_tokens=256, whitebox_tokens=64, down_whitebox_tokens=32,
                         candidates=48, probe_epochs=1)
    doc = run_audit(model, encode, audit_docs, config)
    rows = doc["rows"]
    attacks = {r["attack"] for r in rows}
    assert {"freq", "nn", "lens", "probe-linear", "probe-mlp", "whitebox", "down-nn", "down-lens",
            "down-lens-next", "down-whitebox"} <= attacks
    for r in rows:
        assert {"head", "attack", "defence", "top1", "top5"} <= set(r)
        assert 0.0 <= r["top1"] <= r["top5"] <= 1.0
        if r["attack"] != "freq":
            assert 0.0 <= r["agreement"] <= 1.0

    def top1(k, attack, defence):
        return next(r["top1"] for r in rows if (r["head"], r["attack"], r["defence"]) == (k, attack, defence))
    for k in (1, 2):
        assert top1(k, "whitebox", "none") >= 0.95
        assert top1(k, "whitebox", "noise:2") < top1(k, "whitebox", "none") - 0.3
    q = {(x["head"], x["defence"]): x for x in doc["quality"]}
    assert q[(1, "none")]["agreement"] == 1.0 and q[(1, "noise:2")]["agreement"] < 1.0
    assert [d["head"] for d in doc["depth"]] == [1, 2]
    assert doc["depth"][1]["head_macs_per_token"] == 2 * doc["depth"][0]["head_macs_per_token"]
