"""Give a model built on the `meta` device its stored tensors: no random initialisation, no second copy.

Build the modules under `torch.device("meta")` (shapes only), then `assign_weights`: each tensor
comes from its file's memory map and is cast once, to the run-time dtype on the target device,
and becomes the parameter (`load_state_dict(assign=True)`). A tensor already in that dtype on the
CPU is not copied at all: the parameter stays a (copy-on-write) view of the file's map, whose
pages the kernel can drop and re-read. The non-persistent buffers (RoPE inverse frequencies) are
recomputed for real, in fp32, on the device.
"""

from __future__ import annotations

import torch
from torch import nn

from splitlm import SplitLMError
from splitlm.model.llama import LayerStack
from splitlm.model.weights import Weights


def stored_name(key: str, stacks: dict[str, LayerStack]) -> str:
    """A module's state-dict key -> its name in the weights (`head.layers.0.mlp.up_proj.weight` ->
    `model.layers.{start}.mlp.up_proj.weight`, `norm.weight` -> `model.norm.weight`)."""
    first, _, rest = key.partition(".")
    if first in stacks and rest.startswith("layers."):
        _, j, leaf = rest.split(".", 2)
        return f"model.layers.{stacks[first].start + int(j)}.{leaf}"
    return key if first == "lm_head" else f"model.{key}"


def real_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute each `LayerStack`'s buffers (made on `meta` with the modules) on `device`."""
    for module in model.modules():
        if isinstance(module, LayerStack):
            fresh = LayerStack(module.cfg, module.start, module.start)  # no layers: its buffers only
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after loading: {', '.join(left[:5])}")


def assign_weights(
    model: nn.Module, weights: Weights, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Load `weights` into `model` (built on `meta`): floating tensors as `dtype` on `device`."""
    device = torch.device(device)
    stacks = {name: m for name, m in model.named_children() if isinstance(m, LayerStack)}
    names = {key: stored_name(key, stacks) for key in model.state_dict()}
    missing = [n for n in names.values() if n not in weights.tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise SplitLMError(f"{weights.root}: the weights lack {missing[0]}{more}")

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    loaded = dict(weights.load(dict.fromkeys(names.values()), convert))
    try:
        model.load_state_dict({key: loaded[name] for key, name in names.items()}, strict=True, assign=True)
    except RuntimeError as e:
        raise SplitLMError(f"{weights.root}: the weights do not fit config.json ({e})") from None
    real_buffers(model, device)
    return model
