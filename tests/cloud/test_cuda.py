"""The cloud on a CUDA device (skipped without one; `benchmarks/gpu.sh` runs them): fp32 split decoding
equals transformers' full model on the CPU (a batching cloud on a GPU: tests/cloud/test_batching.py)."""

import pytest
import torch
from test_batching import PROMPTS

from splitlm.cloud.server import BackgroundServer
from splitlm.decoding.modes import SpecConfig
from splitlm.edge import Edge, EdgeConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32: TF32 matrix products would round the cloud's activations to 10-bit mantissas."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def full_model_greedy(path, ids: list[int], n: int) -> list[int]:
    """The oracle: transformers' full model on the CPU, fp32, argmax over the whole sequence each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize("mode", ["none", "auto"])
def test_fp32_cloud_on_cuda_equals_transformers(tiny_llama, tiny_split, mode):
    with BackgroundServer(tiny_split / "cloud", device="cuda", dtype="fp32") as server:
        assert server.server.device.type == "cuda"
        with Edge(tiny_split / "edge", server.url, EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32")) as edge:
            for ids in PROMPTS[:4]:
                got = edge.generate(ids, max_new_tokens=24, stop_at_eos=False, spec=SpecConfig(mode)).token_ids
                assert got == full_model_greedy(tiny_llama, ids, 24), ids
