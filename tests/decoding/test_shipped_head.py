"""The bundled model's draft head ships with the package: found with an empty cache (no training), after
a head the user trained; its training report beside it."""

from __future__ import annotations

import json

import pytest
import torch

from splitlm.decoding.head import (
    HEAD_FILE,
    SHIPPED_DIR,
    cached_head_path,
    find_head,
    head_origin,
    shipped_head_path,
)
from splitlm.result_files import file_digest

BUNDLED_HASH = "dd7fdc71150b856cdd3d354e7ecc3e64"  # the de-quantised SmolLM2-135M-Instruct's weights


def test_the_shipped_head_and_its_report():
    head = shipped_head_path(BUNDLED_HASH)
    report = json.loads(head.with_suffix(".json").read_text())
    assert report["head_sha256"] == file_digest(head) and report["model_hash"] == BUNDLED_HASH
    assert "splitlm train-head --edge" in report["reproduce"]
    assert len(report["heldout"]["conditional"]) == 4 and report["heldout"]["conditional"][0] > 0.5


def test_lookup_order_own_then_cache_then_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITLM_CACHE", str(tmp_path / "empty-cache"))
    edge = tmp_path / "edge"
    edge.mkdir()
    assert find_head(edge, BUNDLED_HASH) == shipped_head_path(BUNDLED_HASH)
    assert head_origin(find_head(edge, BUNDLED_HASH)).startswith("shipped")
    assert find_head(edge, "0" * 32) is None and find_head(edge) is None  # another model: no head
    cached = cached_head_path(BUNDLED_HASH)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"user's")
    assert find_head(edge, BUNDLED_HASH) == cached  # a head the user trained wins
    (edge / HEAD_FILE).write_bytes(b"shard's")
    assert find_head(edge, BUNDLED_HASH) == edge / HEAD_FILE


def test_bench_needs_no_training_for_the_bundled_model(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import splitlm.decoding.train_head as train_head_module
    from splitlm.bench.setup import BenchConfig, ensure_head

    monkeypatch.setenv("SPLITLM_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(train_head_module, "train_head", lambda *a, **k: pytest.fail("trained a head"))
    edge = tmp_path / "edge"
    edge.mkdir()
    ensure_head(
        BenchConfig(),
        tmp_path,
        edge,
        SimpleNamespace(model_hash=BUNDLED_HASH, cloud_layers=(2, 28)),
        ["split-seq", "auto", "head"],
    )


@pytest.mark.slow
def test_a_fresh_split_of_the_bundled_model_drafts_with_the_shipped_head(bundled_split, tmp_path, monkeypatch):
    """With an empty cache, the bundled model's edge (a split made here, no head of its own) loads the
    shipped head and runs it on its own embeddings."""
    from splitlm.edge.drafting import DraftState
    from splitlm.edge.text import TextCodec
    from splitlm.model.shards import load_edge
    from splitlm.result_files import begin_run, provenance

    monkeypatch.setenv("SPLITLM_CACHE", str(tmp_path / "empty-cache"))
    edge_dir = bundled_split / "edge"
    model = load_edge(edge_dir)
    assert model.manifest.model_hash == BUNDLED_HASH  # the key the shipped head is filed under
    assert find_head(edge_dir, model.manifest.model_hash).parent == SHIPPED_DIR
    begin_run(["test"])
    runner = DraftState(edge_dir, model, torch.device("cpu"), TextCodec(edge_dir), with_head=True).head_runner()
    assert runner is not None
    h = model.norm(model.embed_tokens.weight[:2].float())  # [2, D] any final-normed states
    _, probs, ids = runner.step(h, [1, 2], k=4)
    assert probs.shape == ids.shape == (2, 4)
    heads = provenance()["draft_heads"]  # the result files of this run name the head it loaded
    assert [h["sha256"] for h in heads] == [file_digest(shipped_head_path(BUNDLED_HASH))]
