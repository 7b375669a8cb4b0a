"""LoRA adapters on the edge (`--edge-adapter`): the oracle is `peft` on the full `transformers` model."""

import hashlib

import pytest
import torch

from conftest import BUNDLED_PROMPTS, hf_greedy
from splitlm import SplitLMError
from splitlm.cloud.server import BackgroundServer
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.adapters import apply_edge_adapter
from splitlm.model.shards import load_cloud, load_edge
from splitlm.transport.client import CloudClient

PROMPT = [5, 9, 33, 2, 7, 101, 64, 17]


def save_lora(model_dir, out, layers, targets=("q_proj", "v_proj", "down_proj"), scale=0.5, seed=1):
    """A peft LoRA adapter of the full model with random (non-zero) B, saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = get_peft_model(
        hf, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), layers_to_transform=layers, lora_dropout=0.0)
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:  # (peft starts these at zero: no change)
                p.normal_(0, scale)
    lora.save_pretrained(out)
    return out


def peft_model(model_dir, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, adapter).eval()


def split_logits(edge, cloud, ids):
    ids = torch.tensor([ids])
    pos = torch.arange(ids.shape[1])
    with torch.no_grad():
        return edge.tail_and_logits(cloud(edge.embed_and_head(ids, pos), pos), pos)[0]


@pytest.mark.parametrize("targets", [("q_proj", "v_proj", "down_proj"), ("o_proj", "lm_head"), ("embed_tokens",)])
def test_edge_adapter_matches_peft_on_the_full_model(tiny_llama, tiny_split, tmp_path, targets):
    """Head layers 0-1 and tail layers 4-5 of the tiny model; also the tied LM head and the embedding."""
    adapter = save_lora(tiny_llama, tmp_path / "lora", None if targets == ("embed_tokens",) else [0, 1, 4, 5], targets)
    ref = peft_model(tiny_llama, adapter)
    edge, cloud = load_edge(tiny_split / "edge"), load_cloud(tiny_split / "cloud")
    plain = split_logits(edge, cloud, PROMPT)
    info = apply_edge_adapter(edge, adapter)
    assert info.rank == 4 and info.layers == ([] if targets == ("embed_tokens",) else [0, 1, 4, 5])
    got = split_logits(edge, cloud, PROMPT)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    assert (plain - want).abs().max() > 0.5  # the adapter really changes the output
    assert torch.allclose(got, want, atol=1e-4)


def test_adapted_split_generates_peft_tokens_and_sends_nothing_of_the_adapter(
    tiny_llama, tiny_split, tmp_path, monkeypatch
):
    """Greedy through a real cloud: the adapted edge emits what peft's full model emits. Every frame the
    edge sends (in plaintext, before sealing) has the same shape as without the adapter and holds none
    of its bytes; the cloud's shard files and its model's weights stay as they were."""
    adapter = save_lora(tiny_llama, tmp_path / "lora", [0, 1, 4, 5])
    want = hf_greedy(peft_model(tiny_llama, adapter), PROMPT, 16)
    cloud_files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tiny_split / "cloud").iterdir()}
    sent: list = []
    submit = CloudClient._submit

    def record(self, frame):
        sent.append((frame.type, sorted(frame.meta), bytes(frame.payload)))
        return submit(self, frame)

    monkeypatch.setattr(CloudClient, "_submit", record)
    with BackgroundServer(tiny_split / "cloud") as server:
        before = {k: v.clone() for k, v in server.server.model.state_dict().items()}
        frames = {}
        for name, extra in (("plain", {}), ("adapted", {"edge_adapter": adapter})):
            sent.clear()
            with Edge(tiny_split / "edge", server.url, EdgeConfig(wire_dtype="fp32", **extra)) as edge:
                result = edge.generate(PROMPT, 16, spec="none", stop_at_eos=False)
            frames[name] = list(sent)
            if name == "adapted":
                assert result.token_ids == want
            else:
                assert result.token_ids != want
        after = server.server.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tiny_split / "cloud").iterdir()} == cloud_files
    shapes = [[(t, keys, len(payload)) for t, keys, payload in frames[n]] for n in ("plain", "adapted")]
    assert shapes[0] == shapes[1]  # the same requests, the same fields, the same sizes
    from safetensors.torch import load_file

    lora = load_file(adapter / "adapter_model.safetensors")
    needles = [
        t.reshape(-1)[:8].to(dtype).numpy().tobytes() for t in lora.values() for dtype in (torch.float32, torch.float16)
    ]
    assert all(n not in payload for _, _, payload in frames["adapted"] for n in needles)


def test_adapter_on_cloud_layers_is_refused(tiny_llama, tiny_split, tmp_path):
    adapter = save_lora(tiny_llama, tmp_path / "lora", [1, 2])  # layer 2 is the cloud's (layers [2, 4))
    edge = load_edge(tiny_split / "edge")
    weights = {k: v.clone() for k, v in edge.state_dict().items()}
    with pytest.raises(SplitLMError, match=r"layer\(s\) 2, which the cloud runs"):
        apply_edge_adapter(edge, adapter)
    assert all(torch.equal(weights[k], v) for k, v in edge.state_dict().items())  # nothing half-applied
    with pytest.raises(SplitLMError, match="not a peft adapter"):
        apply_edge_adapter(edge, tmp_path)


def test_cli_refuses_a_cloud_adapter(tiny_llama, tiny_split, tmp_path, capsys):
    from splitlm.cli import main

    adapter = save_lora(tiny_llama, tmp_path / "lora", [3])
    code = main(
        [
            "generate",
            "--edge",
            str(tiny_split / "edge"),
            "--cloud",
            "ws://127.0.0.1:9",
            "--edge-adapter",
            str(adapter),
            "--prompt",
            "x",
        ]
    )
    assert code == 1 and "which the cloud runs" in capsys.readouterr().err


def test_train_adapter_fits_the_text_on_edge_layers_only(audit_model_dir, tmp_path, capsys):
    """The CLI on a tiny byte-level model: the loss falls, the adapter names only edge layers, and it applies."""
    import json

    from splitlm.cli import main
    from splitlm.model.shards import split_model

    split = split_model(str(audit_model_dir), head=2, tail=1, out=tmp_path / "split")
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    assert (
        main(
            [
                "train-adapter",
                "--model",
                str(audit_model_dir),
                "--edge",
                str(split / "edge"),
                "--text",
                str(text),
                "--out",
                str(tmp_path / "lora"),
                "--steps",
                "12",
                "--seq-len",
                "48",
                "--lr",
                "3e-3",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["layers"] == [0, 1, 5] and report["loss_after"] < report["loss_before"]
    edge = load_edge(split / "edge")
    info = apply_edge_adapter(edge, tmp_path / "lora")
    assert set(info.layers) == {0, 1, 5}
    assert (
        main(
            [
                "train-adapter",
                "--model",
                str(audit_model_dir),
                "--edge",
                str(split / "edge"),
                "--text",
                str(tmp_path / "missing.txt"),
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 1
    )
    assert "cannot read the training text" in capsys.readouterr().err


@pytest.mark.slow
def test_bundled_edge_adapter_is_token_identical_to_peft(bundled_dir, bundled_split, bundled_server, tmp_path):
    """SmolLM2 (30 layers, edge: 0-1 and 28-29), greedy, fp32: the split with the adapter on the edge emits
    peft's tokens on the full transformers model, and they differ from the base model's."""
    from transformers import AutoTokenizer

    adapter = save_lora(bundled_dir, tmp_path / "lora", [0, 1, 28, 29], ("q_proj", "v_proj", "up_proj"), scale=0.05)
    ref = peft_model(bundled_dir, adapter)
    tok = AutoTokenizer.from_pretrained(bundled_dir)
    changed = 0
    with Edge(
        bundled_split / "edge", bundled_server.url, EdgeConfig(device="cpu", dtype="fp32", edge_adapter=adapter)
    ) as edge:
        for prompt in BUNDLED_PROMPTS:
            ids = tok(prompt).input_ids
            want = hf_greedy(ref, ids, 24)
            assert edge.generate(ids, 24, spec="none").token_ids == want
            assert edge.generate(ids, 24, spec="auto").token_ids == want
            with ref.disable_adapter():
                changed += hf_greedy(ref, ids, 24) != want
    assert changed >= 2


def test_adapter_merged_into_the_onnx_export(tiny_llama, tiny_split, tmp_path, capsys):
    """`export-onnx --edge-adapter`: the graphs carry the adapted weights (peft's logits); the onnx edge
    refuses a second adapter at run time."""
    import json
    import shutil

    from splitlm.cli import main
    from splitlm.edge.onnx_runtime import OnnxEdge

    adapter = save_lora(tiny_llama, tmp_path / "lora", [0, 5], ("q_proj", "up_proj", "lm_head"))
    shutil.copytree(tiny_split / "edge", tmp_path / "edge")
    assert main(["export-onnx", "--edge", str(tmp_path / "edge"), "--edge-adapter", str(adapter)]) == 0
    assert json.loads(capsys.readouterr().out)["adapter"] == str(adapter)
    onnx = OnnxEdge(tmp_path / "edge")
    assert len(onnx.adapter) == 16
    with torch.no_grad():
        want = peft_model(tiny_llama, adapter)(torch.tensor([PROMPT])).logits[0]
    assert torch.allclose(split_logits(onnx, load_cloud(tiny_split / "cloud"), PROMPT), want, atol=1e-4)
    with pytest.raises(SplitLMError, match="merged into the graphs at export"):
        Edge(tmp_path / "edge", "ws://127.0.0.1:9", EdgeConfig(device="onnx", edge_adapter=adapter))
