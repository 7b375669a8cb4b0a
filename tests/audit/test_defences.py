"""Defences on the tiny model: what they change and what they cost."""

import pytest
import torch

from splitlm import SplitLMError
from splitlm.audit.config import AuditConfig
from splitlm.audit.defences import Defence, parse_defence, parse_defences
from splitlm.audit.harden import HardenConfig, harden_head, head_state, relative_distance
from splitlm.audit.run import run_audit
from splitlm.audit.views import SplitView, batched


def test_parse_defences():
    assert [d.name for d in parse_defences("none, noise:0.5,quant:4,harden,harden:7,none")] == [
        "none",
        "noise:0.5",
        "quant:4",
        "harden",
        "harden:7",
    ]
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
    assert names == {
        "model." + k[len("stack.") :] for k in before if k.startswith(("stack.layers.0.", "stack.layers.1."))
    }


def test_audit_rows_adaptive_attackers_and_output_leakage(audit_model, audit_docs):
    model, encode = audit_model
    config = AuditConfig(
        heads=[1, 2],
        tail=2,
        defences=parse_defences("none,noise:2"),
        seq_len=16,
        max_train_tokens=4096,
        max_eval_tokens=256,
        whitebox_tokens=128,
        down_whitebox_tokens=32,
        candidates=48,
        probe_epochs=1,
        output_prompts=2,
        output_tokens=16,
        output_tails=[1, 2],
    )
    doc = run_audit(model, encode, audit_docs, config)
    rows = doc["rows"]
    attacks = {r["attack"] for r in rows}
    assert {
        "freq",
        "nn",
        "lens",
        "probe-linear",
        "probe-mlp",
        "whitebox",
        "down-nn",
        "down-lens",
        "down-lens-next",
        "down-whitebox",
        "tail-output",
    } <= attacks
    for r in rows:
        assert {"head", "attack", "defence", "attacker", "top1", "top5"} <= set(r)
        assert 0.0 <= r["top1"] <= r["top5"] <= 1.0
        if r["attack"] != "freq":
            assert 0.0 <= r["agreement"] <= 1.0
    assert not any(r["attacker"] == "adaptive" for r in rows if r["defence"] == "none")

    def top1(k, attack, defence, who="fixed"):
        return next(
            r["top1"]
            for r in rows
            if (r["head"], r["attack"], r["defence"], r["attacker"]) == (k, attack, defence, who)
        )

    for k in (1, 2):
        assert top1(k, "whitebox", "none") >= 0.95
        assert top1(k, "whitebox", "noise:2") < top1(k, "whitebox", "none") - 0.3
        # the attacker that reruns the noise on its own activations does at least as well with its best attack
        # (linear probe trained on its own noisy activations, or the white-box search scored by the noise's likelihood)
        assert max(top1(k, a, "noise:2", "adaptive") for a in ("probe-linear", "whitebox")) >= max(
            top1(k, a, "noise:2") for a in ("probe-linear", "whitebox")
        )
        # with the public tail the cloud reads the edge's next-token choice, noise or not
        assert top1(k, "tail-output", "none") == top1(k, "tail-output", "noise:2") == 1.0
    q = {(x["head"], x["defence"]): x for x in doc["quality"]}
    assert q[(1, "none")]["agreement"] == 1.0 and q[(1, "noise:2")]["agreement"] < 1.0
    assert [d["head"] for d in doc["depth"]] == [1, 2]
    assert doc["depth"][1]["head_macs_per_token"] == 2 * doc["depth"][0]["head_macs_per_token"]
    generated = [r for r in doc["output"] if r["kind"] == "generated"]
    assert {(r["head"], r["tail"]) for r in generated} == {(k, m) for k in (1, 2) for m in (1, 2)}
    assert all(r["top1"] >= 0.9 for r in generated)  # the undefended split's output, read from the downlink
    assert doc["metadata"]["generations"] == 4 and 0.0 <= doc["metadata"]["classify_shape"] <= 1.0


def test_adaptive_scores_model_the_defence():
    gen = torch.Generator().manual_seed(0)
    cand = torch.randn(1, 40, 64, generator=gen) * torch.linspace(0.5, 3, 40)[None, :, None]  # [1, n, D], scales vary
    quant = Defence("quant", 3)
    observed = quant.apply(cand[:, 7])  # [1, D]
    assert quant.score(cand, observed).argmin().item() == 7  # the candidate that quantises to what was seen
    noise = Defence("noise", 0.5)
    hits = sum(noise.score(cand, noise.apply(cand[:, i], seed=i)).argmin().item() == i for i in range(40))
    assert hits >= 38
