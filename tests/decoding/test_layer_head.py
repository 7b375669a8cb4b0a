"""The head that reads the edge's layers: drafting computes what training unrolled, the split's edge gives
the features the training run read, and decoding with it is exact, on tiny random models."""

import random

import pytest
import torch

from conftest import make_tiny_llama, write_code_warmup
from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.head import load_head, read_head, save_head
from splitlm.decoding.layer_drafter import LayerHeadRunner
from splitlm.decoding.layer_head import LayerHead, LayerHeadShape, unrolled
from splitlm.decoding.local import LocalSession
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.step import StepInput
from splitlm.decoding.suffix import SuffixIndex
from splitlm.decoding.train_layer_head import layer_features
from splitlm.model.loading import load_model

LAYERS = (1, 3)  # K = 1 head layer, the cloud ends at layer 3 of the tiny model's 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("layer-head"), seed=5, vocab_size=64)
    return load_model(path)[0]


def tiny_head(d: int, seed: int = 0) -> LayerHead:
    torch.manual_seed(seed)
    head = LayerHead(LayerHeadShape(d, 2, 1, d // 2, 24), torch.arange(0, 64, 2), LAYERS)
    for p in head.parameters():  # norms too: a head that is not at its start
        p.data.add_(0.05 * torch.randn_like(p))
    return head.eval()


def test_drafting_computes_what_training_unrolled():
    d, t, steps = 16, 12, 4
    head = tiny_head(d)
    emb, lm = torch.randn(64, d), torch.randn(32, d)
    feats, tokens = torch.randn(1, t, 3, d), torch.randint(0, 64, (t + 1,))
    with torch.no_grad():
        logits = unrolled(head, feats, emb[tokens[1:]][None], lm, steps)  # depth j, row s + j: a chain from s
    runner = LayerHeadRunner(head, emb, torch.zeros(64, d).index_copy(0, head.vocab_ids, lm), dtype=torch.float32)
    for s in (0, 3, 7):
        ring = runner.new_ring()
        runner.append(ring, feats[0, : s + 1], tokens[1 : s + 2].tolist(), list(range(s + 1)))
        state = runner.root(ring, [])
        got = [head.readout(state.out, lm)]
        for j in range(1, steps):
            state = runner.step(ring, [state], [int(tokens[s + 1 + j])])[0]
            got.append(head.readout(state.out, lm))
        for j in range(steps):
            assert torch.allclose(got[j], logits[j][0, s + j], atol=1e-4), (s, j)


def test_the_edge_gives_the_features_training_reads(model):
    ids = [random.Random(1).randrange(3, 64) for _ in range(9)]
    ((feats, greedy),) = layer_features(model, [ids], LAYERS)
    step = LocalSession(model, LAYERS).forward(StepInput(ids, feature_rows=[2, 5, 8]))
    assert step.features.shape == (3, 3, model.cfg.hidden_size)
    assert torch.allclose(step.features, feats[[2, 5, 8]].float(), atol=0.05)  # training's are bf16
    assert greedy.tolist() == step.out.argmax(-1).tolist()


def test_decoding_with_the_layer_head_is_exact(model):
    rng = random.Random(0)
    mem = DraftMemory.seeded(SuffixIndex([[rng.randrange(3, 64) for _ in range(200)] for _ in range(4)]))
    w = model.embed_tokens.weight
    mem.head = LayerHeadRunner(tiny_head(model.cfg.hidden_size, seed=2), w, w)
    for _ in range(2):
        prompt = [rng.randrange(3, 64) for _ in range(rng.randrange(3, 16))]
        reference = run(model, prompt, Drafter())[0]
        for mode in ("head", "auto"):
            out, stats = run(model, prompt, make_drafter(SpecConfig(mode), memory=mem))
            assert out == reference, mode
            assert max(stats.choices) > 1  # the head drafted
        mem.past.add(reference)


def run(model, prompt, drafter):
    stats, out = SpecStats(), []
    request = DecodeRequest(
        prompt, 24, set(), speculation=Speculation(drafter, StepBudget(max_nodes=64, cost="zero"), stats)
    )
    for new in decode(LocalSession(model, LAYERS), request):
        out.extend(new)
    return out, stats


def test_a_head_is_used_only_by_an_edge_split_where_it_reads(tmp_path):
    edge = tmp_path / "edge"
    edge.mkdir()
    head = tiny_head(16)
    save_head(head, edge / "draft_head.safetensors")
    loaded = read_head(edge / "draft_head.safetensors")
    assert isinstance(loaded, LayerHead) and loaded.shape == head.shape and loaded.feature_layers == LAYERS
    assert torch.equal(loaded.q.weight, head.q.weight)
    assert load_head(edge, layers=LAYERS) is not None
    assert load_head(edge, layers=(2, 3)) is None  # another split: its features are not these


def test_train_head_trains_a_layer_head_the_edge_loads(audit_model_dir, tmp_path, monkeypatch):
    import json

    from splitlm.decoding.train_layer_head import LayerHeadSettings, train_layer_head
    from splitlm.model.shards import split_model

    monkeypatch.setenv("SPLITLM_CACHE", str(tmp_path / "cache"))
    split = split_model(str(audit_model_dir), head=2, tail=2, out=tmp_path / "split")
    warm = write_code_warmup(tmp_path / "w.jsonl.gz")
    settings = LayerHeadSettings(max_tokens=3000, vocab=64, inner=32, minutes=0.3, epochs=6, batch_tokens=256, lr=3e-3)
    report = train_layer_head(
        str(audit_model_dir), split / "edge", warmup=warm, settings=settings, out=tmp_path / "results"
    )
    assert report["kind"] == "layers" and report["loss_last"] < report["loss_first"]
    beside = json.loads((split / "edge" / "draft_head.json").read_text())
    assert beside["heldout"] == report["heldout"] and len(report["heldout"]["conditional"]) == settings.steps
    assert (tmp_path / "results").glob("train-head-*.json")
    head = load_head(split / "edge", layers=(2, report["feature_layers"][1]))
    assert isinstance(head, LayerHead) and head.feature_layers == tuple(report["feature_layers"])
    assert load_head(split / "edge", layers=(1, report["feature_layers"][1])) is None  # another split


def test_a_head_started_from_the_final_state_reads_it_out_unchanged():
    d, t = 16, 7
    head = LayerHead(LayerHeadShape(d, 2, 1, d // 2, 24), torch.arange(0, 64, 2), LAYERS).start_from_final_state()
    emb, lm = torch.randn(64, d), torch.randn(32, d)
    feats = torch.randn(1, t, 3, d)
    with torch.no_grad():
        first = unrolled(head, feats, emb[torch.randint(0, 64, (1, t))], lm, 1)[0]
    torch.testing.assert_close(first, head.readout(feats[:, :, 2], lm))
