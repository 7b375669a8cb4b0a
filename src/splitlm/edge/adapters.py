"""LoRA adapters on the edge (`--edge-adapter PATH`): a `peft` adapter saved for the full model,
applied to the modules the edge holds (head layers, tail layers, embedding, LM head).

The adapter's tensors name the full model's modules (`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`).
Every module it touches must be the edge's: one in the cloud's layers is refused, since the cloud's
shard is never changed and nothing of the adapter leaves this machine. `peft` injects its LoRA
layers into a view of the edge model under the full model's module names and merges them into
the weights (W += B A · scale), so the edge then runs as before (greedy head, bf16, ONNX export),
at no extra cost per step. A tied LM head that the adapter changes (directly, or through the
embedding) is untied first, as `peft` leaves the tied twin unchanged on the full model.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from splitlm import SplitLMError
from splitlm.model.linear import forget_blocked

log = logging.getLogger(__name__)

PREFIX = "base_model.model."


@dataclass
class AdapterInfo:
    path: str
    modules: list[str]  # full-model names of the modules it changed
    layers: list[int] = field(default_factory=list)
    rank: int = 0
    digest: str = ""  # sha256 of the adapter's tensors (names and bytes), first 16 hex digits

    def describe(self) -> str:
        return f"LoRA r={self.rank} on {len(self.modules)} modules (layers {self.layers or 'none'}) from {self.path}"


def _module_of(key: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> `model.layers.0.self_attn.q_proj`."""
    name = key.removeprefix(PREFIX)
    for marker in (
        ".lora_A",
        ".lora_B",
        ".lora_embedding_A",
        ".lora_embedding_B",
        ".lora_magnitude_vector",
        ".base_layer",
    ):  # (peft saves a targeted embedding's or tied head's base weight too)
        if marker in name:
            return name.split(marker)[0]
    return name.rsplit(".", 1)[0]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit() else None


def read_adapter(path: str | Path):
    """(LoraConfig, tensors) of a `peft` adapter directory; a clear error for anything else."""
    from peft import PeftConfig
    from peft.utils import load_peft_weights

    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise SplitLMError(f"{path}: not a peft adapter directory (no adapter_config.json)")
    try:
        config = PeftConfig.from_pretrained(str(path))
        weights = load_peft_weights(str(path), device="cpu")
    except Exception as e:  # peft's own errors: a broken or foreign file
        raise SplitLMError(f"{path}: cannot read the adapter: {e}") from None
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind != "LORA":
        raise SplitLMError(f"{path}: a {kind} adapter; the edge applies LoRA adapters only")
    if getattr(config, "modules_to_save", None):
        raise SplitLMError(
            f"{path}: the adapter replaces whole modules ({', '.join(config.modules_to_save)}); "
            "the edge applies LoRA weights only"
        )
    return config, weights


def check_edge_modules(modules: list[str], num_layers: int, head: int, tail: int, split_head: bool) -> None:
    """Refuse an adapter that touches anything the edge does not hold."""
    lo, hi = head, num_layers - tail  # the cloud's layers
    cloud = sorted({i for m in modules if (i := _layer(m)) is not None and lo <= i < hi})
    if cloud:
        raise SplitLMError(
            f"the adapter changes layer(s) {', '.join(map(str, cloud))}, which the cloud runs "
            f"(layers [{lo}, {hi})); an edge adapter may change only layers [0, {head})"
            f"{f' and [{hi}, {num_layers})' if tail else ''}, the embedding and the LM head"
        )
    bad = [m for m in modules if _layer(m) is None and m not in ("model.embed_tokens", "lm_head")]
    if split_head:
        bad += [m for m in modules if m == "lm_head"]
    if bad:
        raise SplitLMError(
            f"the adapter changes {', '.join(sorted(set(bad)))}, which the edge does not hold "
            "(or, in the split-head topology, shares with the cloud)"
        )


class _FullModelView(nn.Module):
    """The edge's modules under the full model's names (`model.layers.{i}`, `model.embed_tokens`, `lm_head`)."""

    def __init__(self, edge_model):
        super().__init__()
        inner = nn.Module()
        inner.embed_tokens = edge_model.embed_tokens
        layers = {
            str(s.start + j): block for s in (edge_model.head, edge_model.tail) for j, block in enumerate(s.layers)
        }
        inner.layers = nn.ModuleDict(layers)
        self.model = inner
        if edge_model.lm_head is not None:
            self.lm_head = edge_model.lm_head


def _untie(edge_model) -> None:
    """Give a tied LM head its own copy of the embedding table."""
    w = edge_model.embed_tokens.weight
    head = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        head.weight.copy_(w)
    edge_model.lm_head = head


def _merge_into_base(view: nn.Module) -> None:
    """Merge every injected LoRA layer into its base layer and put the base layer back in its place."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(view.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()  # peft adds B A into `weight.data` in place, which bumps no version counter
            base = module.get_base_layer()
            forget_blocked(base)
            parent_name, _, child = name.rpartition(".")
            setattr(view.get_submodule(parent_name) if parent_name else view, child, base)


def _digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode())
        h.update(weights[k].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def apply_edge_adapter(edge_model, path: str | Path) -> AdapterInfo:
    """Merge the LoRA adapter at `path` into `edge_model` (an `EdgeModel`, in place)."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    config, weights = read_adapter(path)
    modules = sorted({_module_of(k) for k in weights})
    if not modules:
        raise SplitLMError(f"{path}: the adapter holds no tensors")
    m = edge_model.manifest
    check_edge_modules(modules, m.num_layers, m.head, m.tail, edge_model.split_head)
    if edge_model.lm_head is None and ({"lm_head", "model.embed_tokens"} & set(modules)):
        _untie(edge_model)  # the full model's tied twin stays as it was
    view = _FullModelView(edge_model)
    state = {k.removeprefix(PREFIX): v for k, v in weights.items()}
    inject_adapter_in_model(config, view, state_dict=state)
    result = set_peft_model_state_dict(view, state)
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if missing:
        raise SplitLMError(f"{path}: adapter tensors that match no module of the edge: {', '.join(missing[:3])}")
    _merge_into_base(view)  # (peft computes B A · scale in the adapter's dtype, added in the weights')
    layers = sorted({i for mod in modules if (i := _layer(mod)) is not None})
    info = AdapterInfo(str(path), modules, layers, int(getattr(config, "r", 0)), _digest(weights))
    edge_model.forget_greedy_head()  # a screened head built before would hold the old LM head
    log.info("edge adapter: %s", info.describe())
    return info
