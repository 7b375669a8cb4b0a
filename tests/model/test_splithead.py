"""The split-head shards: who holds which weights, and that the two halves of the LM head add up."""

import json

import pytest
import torch

from conftest import make_tiny_llama
from splitlm import SplitLMError
from splitlm.model.shards import load_cloud, load_edge, split_model
from splitlm.model.splithead import cloud_head, edge_logits
from splitlm.model.weights import read_shard_state


def test_shards_hold_their_parts(tiny_split_head, tiny_split):
    edge = read_shard_state(tiny_split_head / "edge")
    cloud = read_shard_state(tiny_split_head / "cloud")
    layers = lambda st: sorted({int(k.split(".")[2]) for k in st if k.startswith("model.layers.")})  # noqa: E731
    assert layers(edge) == [0, 1] and layers(cloud) == [2, 3, 4, 5]
    assert "model.norm.weight" in cloud and "model.norm.weight" not in edge
    assert cloud["lm_head.weight"].shape == (256, 64 - 24)  # W[:, d:]
    assert "lm_head.weight" not in edge  # tied: the edge's W[:, :d] is its embedding's first d columns
    assert torch.equal(cloud["lm_head.weight"], edge["model.embed_tokens.weight"][:, 24:])
    m = json.loads((tiny_split_head / "cloud" / "manifest.json").read_text())
    assert (m["topology"], m["d_end"], m["tail"]) == ("split-head", 24, 0)
    tail_local = json.loads((tiny_split / "cloud" / "manifest.json").read_text())
    assert m["fingerprint"] != tail_local["fingerprint"]


@pytest.mark.parametrize("tied", [True, False])
def test_the_two_halves_add_up_to_the_full_logits(tmp_path, tied):
    model = make_tiny_llama(tmp_path / "m", seed=3, tie_word_embeddings=tied)
    full = split_model(str(model), head=2, tail=0, out=tmp_path / "full")  # all layers but [0,2) on the "cloud"
    sh = split_model(str(model), head=2, tail=0, out=tmp_path / "sh", topology="split-head", d_end=40)
    e_full, c_full = load_edge(full / "edge"), load_cloud(full / "cloud")
    e_sh, c_sh = load_edge(sh / "edge"), load_cloud(sh / "cloud")
    assert e_sh.norm is None and len(e_sh.tail.layers) == 0 and e_sh.end_weight.shape == (256, 40)
    ids, pos = torch.tensor([[5, 9, 77, 3]]), torch.arange(4)
    with torch.no_grad():
        h = c_full(e_full.embed_and_head(ids, pos), pos)  # [1, 4, D]
        expected = e_full.tail_and_logits(h, pos)[0]  # [4, V]
        h_end, z = cloud_head(c_sh, h[0], None)
        torch.testing.assert_close(edge_logits(e_sh, h_end, z, None), expected, rtol=1e-5, atol=1e-5)
        vocab = torch.tensor([2, 7, 100, 255])
        h_end, z = cloud_head(c_sh, h[0], vocab)
        assert z.shape == (4, 4)
        sub = edge_logits(e_sh, h_end, z, vocab)
    assert torch.isinf(sub[:, [0, 1, 3, 254]]).all()
    torch.testing.assert_close(sub[:, vocab], expected[:, vocab], rtol=1e-5, atol=1e-5)


def test_bad_split_head_arguments(tiny_llama, tmp_path):
    with pytest.raises(SplitLMError, match="no tail layers"):
        split_model(str(tiny_llama), head=2, tail=2, out=tmp_path, topology="split-head")
    with pytest.raises(SplitLMError, match="d-end must be"):
        split_model(str(tiny_llama), head=2, tail=0, out=tmp_path, topology="split-head", d_end=64)
    with pytest.raises(SplitLMError, match="only applies"):
        split_model(str(tiny_llama), head=2, tail=2, out=tmp_path, d_end=8)
    with pytest.raises(SplitLMError, match="unknown topology"):
        split_model(str(tiny_llama), head=2, tail=0, out=tmp_path, topology="tail-cloud")
    assert (
        json.loads(
            (
                split_model(str(tiny_llama), head=3, tail=0, out=tmp_path / "d", topology="split-head")
                / "edge"
                / "manifest.json"
            ).read_text()
        )["d_end"]
        == 32
    )  # default: half of 64
