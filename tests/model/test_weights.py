"""Weights on disk: bounded shard files with an index, sharded and single-file checkpoints, the
stored dtype, clear errors for missing or damaged files, and loading on the meta device."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_llama
from splitlm import SplitLMError
from splitlm.cli import main
from splitlm.model.loading import load_model
from splitlm.model.shards import Manifest, load_cloud, load_edge, split_model
from splitlm.model.weights import (
    TensorSpec,
    checkpoint_weights,
    read_shard_state,
    shard_weights,
    write_safetensors,
    write_state,
)


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_shards_are_bounded_files_with_an_index(tiny_llama, tiny_split, tmp_path):
    out = split_model(str(tiny_llama), 2, 2, tmp_path / "small", max_file_mb=0.05)
    for role in ("edge", "cloud"):
        files = sorted((out / role).glob("weights-*.safetensors"))
        index = json.loads((out / role / "weights.safetensors.index.json").read_text())
        assert len(files) > 2 and sorted(set(index["weight_map"].values())) == [f.name for f in files]
        assert all(f.name.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
        for f in files:  # within the bound (+ its header), or one tensor larger than the bound
            assert f.stat().st_size <= 0.05 * 2**20 + 4096 or list(index["weight_map"].values()).count(f.name) == 1
        assert index["metadata"]["total_size"] == shard_weights(out / role).nbytes()
        assert states_equal(read_shard_state(out / role), read_shard_state(tiny_split / role))
        assert states_equal(
            load_file(files[0]),
            {k: v for k, v in read_shard_state(out / role).items() if index["weight_map"][k] == files[0].name},
        )


def test_writer_output_is_valid_safetensors(tmp_path):
    state = {
        "a": torch.randn(3, 5, dtype=torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.ones(0, 4),
        "d": torch.tensor([True, False]),
        "e": torch.randn(2, 2, dtype=torch.float16),
    }
    specs = {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in state.items()}
    write_safetensors(tmp_path / "x.safetensors", specs, state.__getitem__)
    assert states_equal(load_file(tmp_path / "x.safetensors"), state)
    with pytest.raises(ValueError, match="planned"):
        write_safetensors(tmp_path / "y.safetensors", specs, lambda name: state["a"])


def test_a_sharded_checkpoint_splits_like_a_single_file(tiny_llama, tiny_split, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    (sharded / "stray.safetensors").write_bytes(b"not listed in the index, not read")
    out = split_model(str(sharded), 2, 2, tmp_path / "split")
    for role in ("edge", "cloud"):
        assert states_equal(read_shard_state(out / role), read_shard_state(tiny_split / role))
    full, _ = load_model(sharded)
    ref, _ = load_model(tiny_llama)
    assert states_equal(full.state_dict(), ref.state_dict())


def test_missing_and_truncated_files_fail_clearly(tiny_llama, tiny_split, tmp_path):

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(SplitLMError, match=r"model\.safetensors is not a valid safetensors file \(truncated"):
        split_model(str(ckpt), 2, 2, tmp_path / "x")
    weights.write_bytes(b"\x10")
    with pytest.raises(SplitLMError, match="model.safetensors is not a valid safetensors file"):
        load_model(ckpt)

    shard = tmp_path / "shard"
    shutil.copytree(tiny_split, shard)
    files = sorted((shard / "cloud").glob("weights-*.safetensors"))
    small = split_model(str(tiny_llama), 2, 2, tmp_path / "small", max_file_mb=0.05)
    second = sorted((small / "cloud").glob("weights-*.safetensors"))[1]
    second.unlink()
    with pytest.raises(SplitLMError, match=f"{second.name}: missing"):
        load_cloud(small / "cloud")
    good = files[0].read_bytes()
    files[0].write_bytes(good[:-10])
    with pytest.raises(SplitLMError, match=f"{files[0].name}: checksum mismatch"):
        load_cloud(shard / "cloud")
    # a shard written before checksums (no "sha256" in its index) is still read, and the header check holds
    index = shard / "cloud" / "weights.safetensors.index.json"
    doc = json.loads(index.read_text())
    del doc["metadata"]["sha256"]
    index.write_text(json.dumps(doc))
    with pytest.raises(SplitLMError, match=f"{files[0].name} is not a valid safetensors file .*past the end"):
        load_cloud(shard / "cloud")
    (shard / "edge" / "weights.safetensors.index.json").unlink()
    with pytest.raises(SplitLMError, match="the shard has no weights"):
        load_edge(shard / "edge")


def test_older_shards_with_one_weights_file_still_load(tiny_split, tmp_path):

    old = tmp_path / "old"
    shutil.copytree(tiny_split, old)
    for role in ("edge", "cloud"):
        d = old / role
        state = read_shard_state(d)
        for f in [*d.glob("weights-*.safetensors"), d / "weights.safetensors.index.json"]:
            f.unlink()
        save_file({k: v.contiguous() for k, v in state.items()}, d / "weights.safetensors")
        manifest = json.loads((d / "manifest.json").read_text())
        (d / "manifest.json").write_text(json.dumps({**manifest, "format": "splitlm-shard/1"}))
    edge, ref = load_edge(old / "edge"), load_edge(tiny_split / "edge")
    assert states_equal(edge.state_dict(), ref.state_dict())
    assert load_cloud(old / "cloud").manifest.fingerprint == ref.manifest.fingerprint


def test_stored_dtype_auto_and_casts(tmp_path):
    model = make_tiny_llama(tmp_path / "m", seed=5, tie_word_embeddings=False)
    ref = load_file(model / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in ref.items()}, model / "model.safetensors")
    auto = split_model(str(model), 2, 2, tmp_path / "auto")
    half = split_model(str(model), 2, 2, tmp_path / "half", dtype="fp16")
    wide = split_model(str(model), 2, 2, tmp_path / "wide", dtype="fp32")
    manifests = [Manifest.read(d / "cloud", "cloud") for d in (auto, half, wide)]
    assert [m.dtype for m in manifests] == ["bf16", "fp16", "fp32"]
    assert len({m.fingerprint for m in manifests}) == 3  # the stored dtype is part of the split
    assert {t.dtype for t in read_shard_state(auto / "edge").values()} == {torch.bfloat16}
    assert {t.dtype for t in read_shard_state(half / "cloud").values()} == {torch.float16}

    edge = load_edge(auto / "edge")  # dtype None: as stored
    assert {p.dtype for p in edge.parameters()} == {torch.bfloat16}
    edge32 = load_edge(auto / "edge", device=torch.device("cpu"), dtype=torch.float32)
    assert {p.dtype for p in edge32.parameters()} == {torch.float32}
    assert edge32.manifest.fingerprint == edge.manifest.fingerprint  # the run-time dtype is not in it
    for stack in (edge.head, edge.tail, edge32.head):
        assert not stack.inv_freq.is_meta and stack.inv_freq.dtype == torch.float32
        assert torch.equal(stack.inv_freq, load_model(model)[0].stack.inv_freq)
    full16, _ = load_model(model, dtype=None)
    assert full16.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(edge32.lm_head.weight, ref["lm_head.weight"].to(torch.bfloat16).float())


def test_loading_keeps_views_and_rewrites_never_truncate(tiny_split, tmp_path):

    d = tmp_path / "edge"
    shutil.copytree(tiny_split / "edge", d)
    edge = load_edge(d)
    before = {k: v.clone() for k, v in edge.state_dict().items()}
    with torch.no_grad():
        edge.embed_tokens.weight.add_(1.0)  # copy-on-write: the file keeps its bytes
    assert torch.equal(read_shard_state(d)["model.embed_tokens.weight"], before["embed_tokens.weight"])
    edge.embed_tokens.weight.data.copy_(before["embed_tokens.weight"])
    state = read_shard_state(d)
    write_state(d, {k: torch.zeros_like(v) for k, v in state.items()}, max_file_mb=0.05)  # replaces every file
    assert not (d / "weights-00001-of-00001.safetensors").exists()
    assert states_equal(edge.state_dict(), before)  # the loaded model still reads the old files' pages
    assert all(not v.any() for v in read_shard_state(d).values())


def test_split_and_shard_loading_need_no_transformers(tiny_llama, tmp_path):
    code = (
        "import sys; from splitlm.cli import main; "
        f"assert main(['split', '--model', {str(tiny_llama)!r}, '--out', {str(tmp_path / 's')!r}, "
        "'--max-file-mb', '1']) == 0; "
        "from splitlm.model.shards import load_cloud, load_edge; "
        f"load_edge({str(tmp_path / 's' / 'edge')!r}); load_cloud({str(tmp_path / 's' / 'cloud')!r}); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2] == "[]"


def test_cli_split_options(tiny_llama, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["split", "--help"])
    text = capsys.readouterr().out
    assert "--max-file-mb" in text and "auto" in text
    with pytest.raises(SystemExit):
        main(["split", "--model", str(tiny_llama), "--out", str(tmp_path / "x"), "--max-file-mb", "0"])
    assert main(["split", "--model", str(tiny_llama), "--out", str(tmp_path / "y"), "--dtype", "bf16"]) == 0
    assert Manifest.read(tmp_path / "y" / "edge", "edge").dtype == "bf16"
    assert checkpoint_weights(tiny_llama).dominant_dtype() == torch.float32


def test_a_shard_changed_in_place_fails_its_checksum(tiny_split, tmp_path):
    """Same size, different bytes (weights damaged in place): refused on load, not NaNs later."""
    shard = tmp_path / "shard"
    shutil.copytree(tiny_split, shard)
    index = json.loads((shard / "edge" / "weights.safetensors.index.json").read_text())
    assert set(index["metadata"]["sha256"]) == set(index["weight_map"].values())
    path = shard / "edge" / sorted(index["metadata"]["sha256"])[0]
    data = bytearray(path.read_bytes())
    data[-4:] = b"\xff\xff\xff\x7f"  # the last float of the last tensor becomes a NaN
    path.write_bytes(bytes(data))
    with pytest.raises(SplitLMError, match=f"{path.name}: checksum mismatch"):
        load_edge(shard / "edge")
    load_edge(tiny_split / "edge")  # the untouched shard verifies
