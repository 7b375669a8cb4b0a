"""Lean split and lean load on realistic synthetic checkpoints: a bf16 model of TinyLlama-1.1B's shape
(peak memory of `splitlm split` and `splitlm serve-cloud`, split inference against the full model)
and a small Qwen2-shaped one (q/k/v biases, tied head) checked against transformers too."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from splitlm.model.loading import load_model
from splitlm.model.shards import load_cloud, load_edge, split_model
from splitlm.model.weights import checkpoint_weights, shard_weights

MB = 10**6


def status_mb(pid: int | str = "self") -> dict[str, float]:
    """VmRSS and VmHWM (peak) of a process, in MB."""
    with open(f"/proc/{pid}/status") as f:
        return {
            k: int(v.split()[0]) * 1024 / MB for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")
        }


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def disk_bytes(shard_dir: Path) -> int:
    return sum(p.stat().st_size for p in shard_dir.glob("*.safetensors"))


def split_greedy(edge, cloud, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits [n, V] through edge head -> cloud middle -> edge tail, with KV caches."""
    caches = edge.head.new_cache(), cloud.middle.new_cache(), edge.tail.new_cache()
    x, pos = torch.tensor([ids]), torch.arange(len(ids))
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(n):
            h = edge.embed_and_head(x, pos, cache=caches[0])
            h = cloud(h, pos, cache=caches[1])
            z = edge.tail_and_logits(h, pos, cache=caches[2])[0, -1].float()  # [V]
            tokens.append(int(z.argmax()))
            logits.append(z)
            x, pos = torch.tensor([[tokens[-1]]]), torch.tensor([pos[-1] + 1])
    return tokens, torch.stack(logits)


def check_split_matches_full(full, edge, cloud, rel_tol: float, n_prompts: int = 3, n: int = 4) -> float:
    """The split's greedy tokens are the full model's (teacher-forced, one pass), logits within rel_tol."""
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for _ in range(n_prompts):
        ids = torch.randint(0, full.cfg.vocab_size, (6,), generator=g).tolist()
        tokens, z_split = split_greedy(edge, cloud, ids, n)
        seq = ids + tokens[:-1]
        with torch.no_grad():
            z_full = full(torch.tensor([seq]), torch.arange(len(seq)))[0, len(ids) - 1 :].float()  # [n, V]
        assert z_full.argmax(-1).tolist() == tokens
        err = float((z_full - z_split).abs().max() / z_full.abs().max())
        assert err <= rel_tol, err
        worst = max(worst, err)
    return worst


# --- Qwen2-shaped, fp32 -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_split(synthetic_qwen2, tmp_path_factory) -> Path:
    return split_model(str(synthetic_qwen2), head=2, tail=2, out=tmp_path_factory.mktemp("qwen2-split"), max_file_mb=16)


def test_qwen2_checkpoint_is_what_transformers_reads(synthetic_qwen2):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(synthetic_qwen2, dtype=torch.float32).eval()
    ours, _ = load_model(synthetic_qwen2)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z_hf, z = hf(ids).logits[0], ours(ids, torch.arange(12))[0]
    assert torch.allclose(z, z_hf, atol=1e-3 * float(z_hf.abs().max()))
    assert (z_hf.topk(2).values[:, 0] - z_hf.topk(2).values[:, 1]).min() > 0.1 * z_hf.std()  # decisive


def test_qwen2_split_inference_equals_the_full_model(synthetic_qwen2, qwen2_split):
    full, _ = load_model(synthetic_qwen2, dtype=None)
    edge, cloud = load_edge(qwen2_split / "edge"), load_cloud(qwen2_split / "cloud")
    assert json.loads((qwen2_split / "cloud" / "manifest.json").read_text())["dtype"] == "fp32"
    assert len(list((qwen2_split / "cloud").glob("weights-*.safetensors"))) > 1
    assert edge.lm_head is None and edge.head_weight is edge.embed_tokens.weight  # tied
    check_split_matches_full(full, edge, cloud, rel_tol=1e-4)


def test_qwen2_run_time_dtype_is_separate_from_the_stored_one(synthetic_qwen2, qwen2_split):
    full, _ = load_model(synthetic_qwen2, dtype=torch.bfloat16)
    edge = load_edge(qwen2_split / "edge", dtype=torch.bfloat16)
    cloud = load_cloud(qwen2_split / "cloud", device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in [*edge.parameters(), *cloud.parameters()]} == {torch.bfloat16}
    assert edge.head.inv_freq.dtype == cloud.middle.inv_freq.dtype == torch.float32
    assert (
        edge.manifest.fingerprint == cloud.manifest.fingerprint == load_edge(qwen2_split / "edge").manifest.fingerprint
    )
    check_split_matches_full(full, edge, cloud, rel_tol=0.02)


# --- TinyLlama-1.1B-shaped, bf16 ----------------------------------------------------------------


@pytest.fixture(scope="module")
def split_1b(synthetic_llama_1b, tmp_path_factory) -> dict:
    """`python -m splitlm split` of the 1B model in a subprocess, with its peak RSS (of a parent that runs only it)."""
    out = tmp_path_factory.mktemp("split-1b") / "split"
    probe = (
        "import resource, subprocess, sys; "
        f"code = subprocess.call([sys.executable, '-m', 'splitlm', 'split', '--model', {str(synthetic_llama_1b)!r}, "
        f"'--out', {str(out)!r}]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
    )
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return {"out": out, "seconds": time.perf_counter() - t0, "peak_mb": int(result.stdout.split()[-1]) * 1024 / MB}


@pytest.mark.slow
def test_split_of_1b_checkpoint_keeps_a_small_peak(split_1b, synthetic_llama_1b):
    out = split_1b["out"]
    sizes = {role: disk_bytes(out / role) for role in ("edge", "cloud")}
    print(
        f"\nsplit 1.1B bf16: peak RSS {split_1b['peak_mb']:.0f} MB in {split_1b['seconds']:.1f} s; "
        f"edge {sizes['edge'] / MB:.0f} MB, cloud {sizes['cloud'] / MB:.0f} MB"
    )
    assert split_1b["peak_mb"] < 1600
    assert json.loads((out / "cloud" / "manifest.json").read_text())["dtype"] == "bf16"
    assert all(p.stat().st_size <= 512 * 2**20 for p in out.glob("*/weights-*.safetensors"))
    assert len(list((out / "cloud").glob("weights-*.safetensors"))) >= 3
    stored = shard_weights(out / "edge").nbytes() + shard_weights(out / "cloud").nbytes()
    assert stored == checkpoint_weights(synthetic_llama_1b).nbytes()  # every tensor once, still bf16


@pytest.mark.slow
def test_serve_cloud_of_1b_shard_holds_about_the_shard(split_1b):
    from conftest import cloud_forward
    from splitlm.cloud.local import free_port, wait_healthy
    from splitlm.model.shards import Manifest
    from splitlm.transport.client import CloudClient
    from splitlm.transport.messages import Open

    shard = split_1b["out"] / "cloud"
    port = free_port()
    # in the dtype it is stored in (--dtype auto would be fp32 on a CPU: twice the bytes)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitlm",
            "serve-cloud",
            "--shard",
            str(shard),
            "--port",
            str(port),
            "--threads",
            "1",
            "--dtype",
            "bf16",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        t0 = time.perf_counter()
        wait_healthy(port, proc)
        ready = time.perf_counter() - t0
        client = CloudClient(f"ws://127.0.0.1:{port}", Manifest.read(shard, "cloud").fingerprint)
        try:  # one forward touches every weight of the shard
            sid = client.open(Open("fp16")).session
            out = cloud_forward(client, sid, torch.randn(4, 2048), [0, 1, 2, 3], "fp16").hidden
        finally:
            client.close()
        assert out.shape == (4, 2048) and torch.isfinite(out).all()
        peak = status_mb(proc.pid)["VmHWM"]
    finally:
        proc.terminate()
        proc.wait(30)
    size = disk_bytes(shard) / MB
    print(f"\nserve-cloud 1.1B bf16 (cloud shard {size:.0f} MB): healthy in {ready:.1f} s, peak RSS {peak:.0f} MB")
    assert peak < 1.2 * size + 400


@pytest.mark.slow
def test_loading_a_shard_does_not_materialise_it_twice(split_1b):
    shard = split_1b["out"] / "cloud"
    size = disk_bytes(shard) / MB
    x, pos = torch.randn(1, 4, 2048, dtype=torch.bfloat16), torch.arange(4)
    for dtype in (None, torch.float16):  # as stored (views of the files), and cast (copies)
        gc.collect()
        reset_peak()
        base = status_mb()["VmRSS"]
        cloud = load_cloud(shard, dtype=dtype)
        with torch.no_grad():
            cloud(x.to(dtype or torch.bfloat16), pos)  # touches every weight
        rise = status_mb()["VmHWM"] - base
        print(f"\nload_cloud 1.1B (shard {size:.0f} MB, dtype {dtype}): RSS rose by {rise:.0f} MB at peak")
        assert rise <= 1.15 * size
        del cloud


@pytest.mark.slow
def test_1b_split_inference_equals_the_full_model(synthetic_llama_1b, split_1b):
    out = split_1b["out"]
    full, _ = load_model(synthetic_llama_1b, dtype=None)
    assert full.embed_tokens.weight.dtype == torch.bfloat16 and full.lm_head is not None
    edge, cloud = load_edge(out / "edge"), load_cloud(out / "cloud")
    worst = check_split_matches_full(full, edge, cloud, rel_tol=0.03)
    print(f"\n1.1B bf16 split vs full: worst logit difference {worst:.4f} of the largest logit")
