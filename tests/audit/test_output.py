"""Output leakage and metadata on the tiny model: real speculative decoding, recorded as the cloud sees it."""

import pytest
import torch

from splitlm.audit.data import build_corpus
from splitlm.audit.harden import HardenConfig, harden_head
from splitlm.audit.metadata import classify, known_count, metadata_audit
from splitlm.audit.output import cloud_outputs, output_leakage
from splitlm.audit.traces import Step, Trace, trace_generation
from splitlm.audit.views import SplitView, batched

PROMPTS = [("code", "def f(x):\n    return x + 1\n\ndef g(x):\n"), ("prose", "The river runs to the sea and the sea")]


@pytest.fixture(scope="module")
def traces(audit_model):
    model, encode = audit_model
    return [trace_generation(model, encode(p), label, {0, 3, 4}, max_new_tokens=20) for label, p in PROMPTS]


def test_the_public_tail_reads_every_output_and_generated_token(audit_model, traces):
    model, _ = audit_model
    assert all(len(t.generated) == 20 for t in traces) and any(len(s.ids) > 1 for t in traces for s in t.steps[1:])
    for t in traces:  # the recorded rows are what the model computed: the edge's outputs are the generated tokens
        assert [t.steps[0].out[-1]] + [s.out[r] for s in t.steps[1:-1] for r in s.keep] == t.generated[
            : len(t.generated) - len(t.steps[-1].keep)
        ]
        assert cloud_outputs(model, t, 2) == [s.out for s in t.steps]

    class NoProbe:  # a probe that never names a token: generated text must come from the downlink
        def rank(self, h, k):
            return torch.full((h.shape[0], k), -1)

    rows = output_leakage(model, traces, [1], [1, 2], {1: NoProbe()})
    for m in (1, 2):
        gen = next(r for r in rows if r["kind"] == "generated" and r["tail"] == m)
        assert gen["top1"] >= 0.9 and gen["tokens"] == 40
        assert next(r for r in rows if r["kind"] == "row-outputs" and r["tail"] == m)["top1"] == 1.0
        drafts = next(r for r in rows if r["kind"] == "drafts" and r["tail"] == m)
        accepted = drafts["tokens"] - drafts["rejected"]
        assert drafts["top1"] * drafts["tokens"] >= accepted - 1e-6  # every accepted draft is its parent's output
    assert next(r for r in rows if r["kind"] == "drafts" and r["via"] == "uplink-probe")["top1"] == 0.0


def test_a_private_tail_hides_the_output_from_the_public_tail(audit_model, audit_docs):
    model, encode = audit_model
    corpus = build_corpus(audit_docs, encode, model.cfg.vocab_size, 16, 2048, 128)
    view = SplitView(model, 2, 2)
    result = harden_head(view, corpus.train, HardenConfig(steps=20, lr=3e-3, tail=True))
    assert result.tail is not None
    hard = SplitView(model, 2, 2, private_head=result.head, private_tail=result.tail)
    down = batched(lambda x: hard.down(hard.up(x)), corpus.held_out)
    edge = batched(hard.logits, down).argmax(-1)
    cloud = batched(lambda d: hard.logits(d, hard.public_tail), down).argmax(-1)
    assert (cloud == edge).float().mean() < 0.9


def test_metadata_counts_and_classifies_step_shapes():
    def trace(label, accepted):  # steps of one root + `a` accepted drafts + one rejected draft
        t = Trace(label, [5] * 4, steps=[Step([5] * 4, [0, 1, 2, 3], None, [7] * 4, {}, True)])
        pos = 4
        for a in accepted:
            t.steps.append(
                Step(
                    [7] * (a + 2),
                    list(range(pos, pos + a + 2)),
                    None,
                    [7] * (a + 2),
                    {},
                    False,
                    keep=list(range(a + 1)),
                )
            )
            pos += a + 1
        t.generated = [7] * (1 + sum(a + 1 for a in accepted))
        return t

    traces = [trace("code", [3, 2, 3, 0]) for _ in range(4)] + [trace("prose", [0, 0, 1, 0, 0, 0]) for _ in range(4)]
    assert known_count(traces[0]) == 1 + 4 + 3 + 4 + 1 == len(traces[0].generated)  # the last step accepted nothing
    assert classify(traces, ["mean_accepted", "accept_rate"]) == 1.0
    meta = metadata_audit(traces)
    assert meta["count_exact_known"] == 1.0 and meta["classify_shape"] == 1.0
    assert meta["fixed_shape_row_overhead"] > 0
