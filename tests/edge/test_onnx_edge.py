"""`--device onnx`: the edge's graphs in ONNX Runtime against the torch edge (tiny model, and the bundled model)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import BUNDLED_PROMPTS
from splitlm import SplitLMError
from splitlm.cloud.server import BackgroundServer
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.step import StepInput
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.onnx_runtime import OnnxEdge, parse_onnx_device
from splitlm.model.device import resolve_device
from splitlm.model.kv_cache import KVCache
from splitlm.model.llama import causal_mask
from splitlm.model.onnx_export import export_edge_onnx
from splitlm.model.shards import load_edge

PROMPT = [5, 9, 33, 2, 7, 101, 64, 17, 5, 9, 33]


@pytest.fixture(scope="module")
def onnx_split(tiny_split, tmp_path_factory):
    """A copy of the tiny split whose edge has fp32 and int8 graphs."""
    out = tmp_path_factory.mktemp("onnx-split")
    shutil.copytree(tiny_split / "edge", out / "edge")
    shutil.copytree(tiny_split / "cloud", out / "cloud")
    export_edge_onnx(load_edge(out / "edge"), out / "edge", int8=True)
    return out


@pytest.fixture(scope="module")
def onnx_server(onnx_split):
    with BackgroundServer(onnx_split / "cloud") as server:
        yield server


def test_graphs_match_the_torch_edge_through_trees_keep_and_crop(onnx_split):
    """Head and tail graphs against the torch modules, with caches driven the way speculative steps drive them:
    a causal prompt, a tree step with a non-causal mask and explicit positions, keep of a branch, a crop."""
    model = load_edge(onnx_split / "edge")
    onnx = OnnxEdge(onnx_split / "edge")
    caches = {name: (KVCache(2, block=4), KVCache(2, block=4)) for name in ("torch", "onnx")}  # buffers grow
    tree = causal_mask(5)
    tree[3, 1:3] = False  # row 3 branches off after row 0: it sees rows 0 and 3 only
    tree[4, 1:3] = False
    steps = [
        (torch.tensor([PROMPT]), torch.arange(len(PROMPT)), None, None),
        (torch.tensor([[40, 41, 42, 43, 44]]), torch.tensor([11, 12, 13, 12, 13]), tree, [0, 3, 4]),
        (torch.tensor([[7]]), torch.tensor([13]), None, None),
    ]
    with torch.no_grad():
        for ids, pos, mask, keep in steps:
            out = {}
            for name, m in (("torch", model), ("onnx", onnx)):
                head, tail = caches[name]
                h = m.embed_and_head(ids, pos, mask, head)
                out[name] = (h, m.tail_and_logits(h.clone(), pos, mask, tail, rows=[0, ids.shape[1] - 1]))
            assert torch.allclose(out["torch"][0], out["onnx"][0], atol=1e-5)
            assert torch.allclose(out["torch"][1], out["onnx"][1], atol=1e-4)
            assert out["torch"][1].shape == out["onnx"][1].shape == (1, 2, model.cfg.vocab_size)
            if keep is not None:
                for cache in (*caches["torch"], *caches["onnx"]):
                    cache.keep(keep)
                    cache.crop(cache.length - 1)  # and drop the last kept entry again
    for t, o in zip(caches["torch"], caches["onnx"], strict=True):
        assert t.length == o.length == len(PROMPT) + 2 + 1
        for i in range(t.num_layers):
            assert torch.allclose(t.view(i)[0], o.view(i)[0], atol=1e-5)


@pytest.mark.parametrize(
    "spec",
    ["none", "ngram", "lookahead", SpecConfig("lookahead", pipeline=True)],
    ids=["none", "ngram", "lookahead", "lookahead-pipelined"],
)
def test_onnx_edge_is_token_identical_to_the_torch_edge(onnx_split, onnx_server, spec):
    with (
        Edge(onnx_split / "edge", onnx_server.url, EdgeConfig(device="cpu", wire_dtype="fp32")) as ref,
        Edge(onnx_split / "edge", onnx_server.url, EdgeConfig(device="onnx", wire_dtype="fp32")) as onnx,
    ):
        for prompt in (PROMPT, [200, 3, 77, 150, 9], [37, 148, 219, 208, 198, 19, 68, 33, 129]):
            want = ref.generate(prompt, 20, spec=spec, stop_at_eos=False)
            got = onnx.generate(prompt, 20, spec=spec, stop_at_eos=False)
            assert got.token_ids == want.token_ids


def test_int8_graphs_run_and_are_smaller(onnx_split, onnx_server):
    fp32 = (onnx_split / "edge" / "onnx" / "tail.onnx").stat().st_size
    int8 = (onnx_split / "edge" / "onnx" / "tail.int8.onnx").stat().st_size
    assert int8 < 0.6 * fp32
    with Edge(onnx_split / "edge", onnx_server.url, EdgeConfig(device="onnx:int8")) as edge:
        assert edge.model.precision == "int8"
        result = edge.generate(PROMPT, 12, spec="lookahead", stop_at_eos=False)
        assert len(result.token_ids) == 12


def test_onnx_device_errors(tiny_split, onnx_split, tmp_path):
    assert parse_onnx_device("onnx") == "fp32" and parse_onnx_device("ONNX:int8") == "int8"
    assert parse_onnx_device("cpu") is None
    with pytest.raises(SplitLMError, match="onnx or onnx:int8"):
        parse_onnx_device("onnx:int4")
    with pytest.raises(SplitLMError, match="only the edge"):
        resolve_device("onnx")  # the cloud's layers never run in ONNX Runtime
    with pytest.raises(SplitLMError, match="export-onnx"):
        OnnxEdge(tiny_split / "edge")  # never exported
    stale = tmp_path / "edge"
    shutil.copytree(onnx_split / "edge", stale)
    manifest = json.loads((stale / "onnx" / "onnx.json").read_text())
    (stale / "onnx" / "onnx.json").write_text(json.dumps({**manifest, "fingerprint": "0" * 32}))
    with pytest.raises(SplitLMError, match="another split"):
        OnnxEdge(stale)
    (stale / "onnx" / "onnx.json").write_text(json.dumps({**manifest, "precisions": ["fp32"]}))
    with pytest.raises(SplitLMError, match="--int8"):
        OnnxEdge(stale, "int8")


def test_cli_export_and_generate_on_onnx(tiny_split, tmp_path, capsys):
    from splitlm.cli import main

    shutil.copytree(tiny_split / "edge", tmp_path / "edge")
    assert main(["export-onnx", "--edge", str(tmp_path / "edge")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["precisions"] == ["fp32"] and set(report["files_mb"]) == {"head.fp32", "tail.fp32"}
    assert (
        main(
            [
                "generate",
                "--edge",
                str(tmp_path / "edge"),
                "--cloud",
                "ws://127.0.0.1:9",
                "--device",
                "onnx",
                "--dtype",
                "bf16",
                "--prompt",
                "x",
            ]
        )
        == 1
    )
    assert "drop --dtype" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--edge",
                str(tmp_path / "edge"),
                "--cloud",
                "ws://127.0.0.1:9",
                "--device",
                "onnx:int8",
                "--prompt",
                "x",
            ]
        )
        == 1
    )
    assert "--int8" in capsys.readouterr().err


@pytest.fixture(scope="module")
def bundled_onnx(bundled_split, tmp_path_factory):
    """A copy of the bundled edge shard with its fp32 and int8 graphs."""
    edge_dir = tmp_path_factory.mktemp("bundled-onnx") / "edge"
    shutil.copytree(bundled_split / "edge", edge_dir)
    export_edge_onnx(load_edge(edge_dir), edge_dir, int8=True)
    return edge_dir


@pytest.mark.slow
def test_bundled_onnx_edge_is_token_identical(bundled_onnx, bundled_server):
    """The bundled model, greedy, with no speculation and with `auto`: the ONNX fp32 edge emits the torch edge's
    tokens."""
    edge_dir = bundled_onnx
    with (
        Edge(edge_dir, bundled_server.url, EdgeConfig(device="cpu", dtype="fp32")) as ref,
        Edge(edge_dir, bundled_server.url, EdgeConfig(device="onnx")) as onnx,
    ):
        for spec in ("none", "auto"):
            for prompt in BUNDLED_PROMPTS:
                want = ref.generate(prompt, 24, spec=spec).token_ids
                assert onnx.generate(prompt, 24, spec=spec).token_ids == want, (spec, prompt)


INT8_AGREEMENT_BOUND = 0.75


@pytest.mark.slow
def test_bundled_int8_edge_agreement_has_a_lower_bound(bundled_onnx, bundled_server):
    """docs/edge-profiles.md: the int8 edge agrees with the fp32 model on 85.4 % of teacher-forced positions
    (164/192, the first 6 tuning prompts x 32). Here: the fp32 torch edge generates 32 tokens greedily for
    each of the first 4 of those prompts, the int8 edge runs prompt + continuation in one forward, and its
    greedy token must be the fp32 one at >= 75 % of the positions. On this machine these 4 prompts give
    111/128 (0.867); over the 12 first tuning prompts single prompts range from 0.66 to 1.0 (mean 0.80),
    so 0.75 over 128 positions leaves room for another CPU's int8 kernels, and still fails an int8 edge
    that lost a tenth of the documented agreement or more. An AVX2-only CPU (no VNNI) gave 63/128 with
    8-bit weights, whose int8 sums saturate there; the export's 7-bit weights on such a CPU give 107/128."""
    prompts = json.loads((Path(__file__).parents[2] / "benchmarks" / "prompts-tuning.json").read_text())[:4]
    hits = total = 0
    with (
        Edge(bundled_onnx, bundled_server.url, EdgeConfig(device="cpu", dtype="fp32", wire_dtype="fp32")) as ref,
        Edge(bundled_onnx, bundled_server.url, EdgeConfig(device="onnx:int8", wire_dtype="fp32")) as int8,
    ):
        for p in prompts:
            ids = ref.text.encode(p["prompt"], chat=p["chat"])
            want = ref.generate(ids, 32, spec="none", stop_at_eos=False).token_ids
            session = int8.open_session()
            try:
                logits = session.forward(StepInput(ids + want[:-1])).out  # [T, V], teacher-forced
            finally:
                session.close()
            got = logits[len(ids) - 1 :].argmax(-1).tolist()
            hits += sum(a == b for a, b in zip(got, want, strict=True))
            total += len(want)
    print(f"\nint8 edge: teacher-forced agreement with the fp32 edge {hits}/{total}")
    assert hits / total >= INT8_AGREEMENT_BOUND, f"int8 agreement {hits}/{total}"


GEMMA3 = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=5,
    final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "full_attention", "full_attention"] * 2,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
    },
)


def test_gemma3_graphs_with_sliding_windows_match_torch(tmp_path):
    """Scaled embedding, sandwich and q/k norms, local RoPE, windows shorter than the context, soft-capping."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from splitlm.model.shards import split_model

    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p)) if p.dim() == 1 else p.mul_(4.0)
    hf.save_pretrained(tmp_path / "gemma3")
    split = split_model(str(tmp_path / "gemma3"), head=2, tail=2, out=tmp_path / "split")  # head: a sliding layer
    model = load_edge(split / "edge")
    export_edge_onnx(model, split / "edge")
    onnx = OnnxEdge(split / "edge")
    caches = {name: (KVCache(2, block=4), KVCache(2, block=4)) for name in ("torch", "onnx")}
    ids = [[7, 20, 31, 44, 5, 60, 71, 8, 9, 90, 11, 12]]
    with torch.no_grad():
        for step in range(4):  # the prompt (longer than the window), then single tokens
            pos = torch.arange(caches["torch"][0].length, caches["torch"][0].length + len(ids[0]))
            out = {}
            for name, m in (("torch", model), ("onnx", onnx)):
                h = m.embed_and_head(torch.tensor(ids), pos, None, caches[name][0])
                out[name] = m.tail_and_logits(h.clone(), pos, None, caches[name][1])
            assert torch.allclose(out["torch"], out["onnx"], atol=1e-4), step
            ids = [[int(out["torch"][0, -1].argmax())]]
