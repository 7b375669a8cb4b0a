"""--device and --dtype: resolution, and that the loaded shards honour them."""

import pytest
import torch

from splitlm import SplitLMError
from splitlm.model.device import resolve_device, resolve_dtype, to_device, to_host
from splitlm.model.shards import load_cloud, load_edge

NO_CUDA = not torch.cuda.is_available()


def test_auto_resolves_to_what_is_here():
    device = resolve_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", device) == (torch.bfloat16 if device.type == "cuda" else torch.float32)
    assert resolve_device(None) == device and resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtypes(name, dtype):
    assert resolve_dtype(name, torch.device("cpu")) == dtype
    assert resolve_dtype(dtype, torch.device("cpu")) == dtype


@pytest.mark.parametrize(
    "spec, message", [("tpu", "unknown device"), ("cuda:x", "unknown device"), ("cuda:", "unknown device")]
)
def test_unknown_devices(spec, message):
    with pytest.raises(SplitLMError, match=message):
        resolve_device(spec)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_where_there_is_none(spec):
    with pytest.raises(SplitLMError, match="no CUDA device"):
        resolve_device(spec)


def test_mps_where_there_is_none():
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(SplitLMError, match="Metal backend is not available"):
        resolve_device("mps")


def test_unknown_dtype():
    with pytest.raises(SplitLMError, match="unknown dtype"):
        resolve_dtype("fp64", torch.device("cpu"))
    with pytest.raises(SplitLMError, match="unsupported compute dtype"):
        resolve_dtype(torch.float64, torch.device("cpu"))


def test_host_device_round_trip():
    t = torch.arange(6.0).view(2, 3)
    assert to_device(t, torch.device("cpu")) is t and to_host(t) is t
    assert to_device(t, torch.device("cpu"), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shards_load_in_the_run_time_dtype(tiny_split, dtype):
    edge = load_edge(tiny_split / "edge", "cpu", dtype)
    cloud = load_cloud(tiny_split / "cloud", "cpu", dtype)
    for model in (edge, cloud):
        assert {p.dtype for p in model.parameters()} == {dtype}
        assert {p.device.type for p in model.parameters()} == {"cpu"}
    # RoPE's inverse frequencies stay fp32 whatever the compute dtype
    assert edge.head.inv_freq.dtype == cloud.middle.inv_freq.dtype == torch.float32
    assert edge.manifest.fingerprint == cloud.manifest.fingerprint  # the run-time dtype is not part of it
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        h = edge.embed_and_head(ids, torch.arange(3))
        logits = edge.tail_and_logits(cloud(h, torch.arange(3)), torch.arange(3))
    assert logits.dtype == dtype and torch.isfinite(logits).all()


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_shards_on_cuda(tiny_split):
    edge = load_edge(tiny_split / "edge", "cuda", torch.bfloat16)
    cloud = load_cloud(tiny_split / "cloud", "cuda", torch.bfloat16)
    assert {p.device.type for m in (edge, cloud) for p in m.parameters()} == {"cuda"}
    ids = torch.tensor([[5, 6, 7]], device="cuda")
    pos = torch.arange(3, device="cuda")
    with torch.inference_mode():
        cache = cloud.middle.new_cache()
        out = cloud(edge.embed_and_head(ids, pos), pos, None, cache)
    assert out.device.type == "cuda" and cache.length == 3
