"""The cloud on a CUDA device (skipped without one; `benchmarks/gpu.sh` runs them): fp32 split decoding
equals transformers' full model on the CPU, and a batching cloud gives each session what it gets alone."""

import threading

import pytest
import torch

from splitlm.cloud.scheduler import BatchConfig
from splitlm.cloud.server import BackgroundServer
from splitlm.decoding.modes import SpecConfig
from splitlm.edge import Edge

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 6, 7], [9, 3, 8, 1], [12, 40], [7, 7, 7, 7, 7], [100, 3, 100, 3, 100], [1, 2, 3, 4, 5, 6, 7, 8],
           [250, 17], [(11 * i) % 200 + 3 for i in range(37)]]


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
    return out[len(ids):]


@pytest.mark.parametrize("mode", ["none", "auto"])
def test_fp32_cloud_on_cuda_equals_transformers(tiny_llama, tiny_split, mode):
    with BackgroundServer(tiny_split / "cloud", device="cuda", dtype="fp32") as server:
        assert server.server.device.type == "cuda"
        with Edge(tiny_split / "edge", server.url, wire_dtype="fp32", device="cpu", dtype="fp32") as edge:
            for ids in PROMPTS[:4]:
                got = edge.generate(ids, max_new_tokens=24, stop_at_eos=False, spec=SpecConfig(mode)).token_ids
                assert got == full_model_greedy(tiny_llama, ids, 24), ids


def test_batching_cloud_on_cuda_gives_each_session_its_own_tokens(tiny_split):
    batch = BatchConfig(max_batch=8, prefill_chunk=16)
    with BackgroundServer(tiny_split / "cloud", device="cuda", dtype="fp32", batch=batch) as server, \
            Edge(tiny_split / "edge", server.url, wire_dtype="fp32", device="cpu", dtype="fp32") as edge:
        def run(i: int) -> list[int]:
            return edge.generate(PROMPTS[i], max_new_tokens=20, stop_at_eos=False,
                                 spec=SpecConfig("auto")).token_ids

        solo = [run(i) for i in range(len(PROMPTS))]
        results: list[list[int] | None] = [None] * len(PROMPTS)
        errors: list[Exception] = []
        barrier = threading.Barrier(len(PROMPTS))

        def thread(i: int) -> None:
            barrier.wait()
            try:
                results[i] = run(i)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=thread, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        registry = server.server.metrics.registry
        assert not errors
        assert results == solo
        assert (registry.get_sample_value("splitlm_cloud_batch_size_sum")
                > registry.get_sample_value("splitlm_cloud_batch_size_count")), "no pass held more than one session"
        assert server.server.sessions.sessions == {}
