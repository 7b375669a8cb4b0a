import json

import pytest

from splitlm import SplitLMError
from splitlm.model.loading import resolve_model
from splitlm.model.shards import Manifest, load_cloud, load_edge, split_model
from splitlm.model.weights import shard_weights


def tensor_names(shard_dir):
    return set(shard_weights(shard_dir).tensors)


def test_cloud_shard_holds_only_middle_layers(tiny_split):
    cloud = tensor_names(tiny_split / "cloud")
    edge = tensor_names(tiny_split / "edge")
    assert cloud, "cloud shard is empty"
    assert {int(n.split(".")[2]) for n in cloud} == {2, 3}  # 6 layers, K=2, M=2
    assert all(n.startswith("model.layers.") for n in cloud)
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.")) for n in edge)
    assert "model.embed_tokens.weight" in edge and "model.norm.weight" in edge
    assert not cloud & edge


def test_manifests_share_a_fingerprint(tiny_split):
    e = Manifest.read(tiny_split / "edge", "edge")
    c = Manifest.read(tiny_split / "cloud", "cloud")
    assert e.fingerprint == c.fingerprint == e.compute_fingerprint()
    assert (e.head, e.tail, e.num_layers, e.dtype) == (2, 2, 6, "fp32")
    assert load_edge(tiny_split / "edge").manifest.fingerprint == load_cloud(tiny_split / "cloud").manifest.fingerprint


def test_different_splits_have_different_fingerprints(tiny_llama, tmp_path):
    a = split_model(str(tiny_llama), 1, 2, tmp_path / "a")
    b = split_model(str(tiny_llama), 2, 1, tmp_path / "b")
    fa = json.loads((a / "cloud" / "manifest.json").read_text())["fingerprint"]
    fb = json.loads((b / "cloud" / "manifest.json").read_text())["fingerprint"]
    assert fa != fb


def test_bad_splits_and_paths(tiny_llama, tmp_path):
    with pytest.raises(SplitLMError, match="no layer for the cloud"):
        split_model(str(tiny_llama), 3, 3, tmp_path / "x")
    with pytest.raises(SplitLMError, match="model not found"):
        split_model(str(tmp_path / "nope"), 2, 2, tmp_path / "x")
    with pytest.raises(SplitLMError, match="not a splitlm shard"):
        load_edge(tmp_path)
    with pytest.raises(SplitLMError, match="is the cloud shard"):
        split_model(str(tiny_llama), 2, 2, tmp_path / "y")
        load_edge(tmp_path / "y" / "cloud")


def test_unsupported_gguf_architecture(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "tiny-gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SplitLMError, match="architecture 'gpt2' is not supported"):
        resolve_model(path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(SplitLMError, match="cannot read GGUF"):
        resolve_model(junk)


def test_cache_lock_keeps_a_second_maker_waiting(tmp_path):
    import fcntl

    from splitlm.model.loading import cache_lock

    entry = tmp_path / "models" / "some-model"
    with cache_lock(entry):
        with open(tmp_path / "models" / "some-model.lock") as other:  # what a second process would open
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "models" / "some-model.lock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
