"""`splitlm bench --pass-cost SHAPE`: the cloud's compute per pass as a function of its new tokens.

The middle layers of a real model's shape (random weights made on the device itself, never read
from disk) run passes of T new tokens after a context of C cached entries, as the cloud does
for a speculative step (a tree of T nodes) or a prefill chunk. Each pass is timed after a
device synchronisation; the figure is the median of `reps` passes, with the cache cropped back
to C in between. The decoding loop's budget learns exactly this curve (c0 + c1·T) online; the
table tells how many tokens a step may verify before the cloud's compute stops being free next to
the WAN's round trip.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from splitlm import SplitLMError
from splitlm.model.config import ModelConfig
from splitlm.model.device import dtype_name
from splitlm.model.llama import LayerStack
from splitlm.model.materialise import real_buffers
from splitlm.model.synthetic import SHAPES, SyntheticSpec, make_tensor, tensor_specs
from splitlm.result_files import time_stamp, write_result

log = logging.getLogger(__name__)


@dataclass
class PassCost:
    shape: str
    device: str
    dtype: str
    layers: int  # middle layers run
    context: int  # cached entries before the pass
    tokens: int  # new tokens in the pass (T)
    ms: float  # median wall time of one pass
    ms_per_token: float


def middle_layers(
    spec: SyntheticSpec, device: torch.device, dtype: torch.dtype, head: int = 2, tail: int = 2
) -> LayerStack:
    """The cloud's layers [head, L - tail) of `spec`, random weights made on `device` in `dtype`."""
    cfg = ModelConfig.from_hf(spec.config)
    if head + tail >= cfg.num_layers:
        raise SplitLMError(f"{spec.name} has {cfg.num_layers} layers: none left for the cloud")
    with torch.device("meta"):
        stack = LayerStack(cfg, head, cfg.num_layers - tail)
    specs = tensor_specs(cfg, dtype)
    state = {}
    for key in stack.state_dict():
        _, j, leaf = key.split(".", 2)  # layers.{j}.{leaf}
        name = f"model.layers.{head + int(j)}.{leaf}"
        state[key] = make_tensor(spec.seed, name, specs[name], device)
    stack.load_state_dict(state, assign=True)
    real_buffers(stack, device)  # its RoPE tables, fp32
    return stack.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(run, device: torch.device, reps: int, reset=None) -> float:
    """The median wall time of `reps` calls of `run()` (after two untimed warm-ups: kernel selection,
    the allocator), each timed between device synchronisations; `reset()` before each, untimed."""
    times = []
    for i in range(reps + 2):
        if reset is not None:
            reset()
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


@torch.inference_mode()
def measure(
    spec: SyntheticSpec, device: torch.device, dtype: torch.dtype, tokens: list[int], context: int = 512, reps: int = 10
) -> list[PassCost]:
    stack = middle_layers(spec, device, dtype)
    cfg = stack.cfg
    gen = torch.Generator(device).manual_seed(0)
    cache = stack.new_cache()
    if context:  # --pass-context 0: every pass starts from an empty cache
        stack(
            torch.randn(1, context, cfg.hidden_size, device=device, generator=gen),
            torch.arange(context, device=device),
            None,
            cache,
        )
    rows = []
    for t in tokens:
        x = torch.randn(1, t, cfg.hidden_size, device=device, generator=gen)  # [1, T, D]
        pos = torch.arange(context, context + t, device=device)
        ms = median_ms(partial(stack, x, pos, None, cache), device, reps, reset=partial(cache.crop, context))
        rows.append(
            PassCost(
                spec.name, str(device), dtype_name(dtype), len(stack.layers), context, t, round(ms, 3), round(ms / t, 4)
            )
        )
        log.info(f"[bench] pass cost {spec.name} {device} {dtype_name(dtype)}: T={t:<4} {ms:8.2f} ms")
    return rows


def pass_cost_doc(
    shape: str, device: torch.device, dtypes: list[torch.dtype], tokens: list[int], context: int, reps: int
) -> dict:
    if shape not in SHAPES:
        raise SplitLMError(f"unknown shape {shape!r} for --pass-cost (choose from {', '.join(SHAPES)})")
    rows = [r for dtype in dtypes for r in measure(SHAPES[shape], device, dtype, tokens, context, reps)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "schema": "splitlm.pass-cost/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "shape": shape,
        "config": SHAPES[shape].config,
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "rows": [asdict(r) for r in rows],
    }


def markdown(doc: dict) -> str:
    lines = [
        f"## Cloud compute per pass: {doc['shape']} middle layers on {doc['device']}"
        f"{' (' + doc['device_name'] + ')' if doc.get('device_name') else ''}",
        "",
        "| dtype | layers | context | T | ms / pass | ms / token |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['dtype']} | {r['layers']} | {r['context']} | {r['tokens']} | {r['ms']:.2f} | {r['ms_per_token']:.3f} |"
        for r in doc["rows"]
    ]
    return "\n".join(lines) + "\n"


def write_results(doc: dict, out: str | Path) -> list[Path]:
    """Write `pass-cost-<shape>-<device type>-<stamp>.json`; returns its path in a list."""
    kind = f"pass-cost-{doc['shape']}-{torch.device(doc['device']).type}"
    return write_result(out, kind, doc, stamp=time_stamp(doc["created"])).paths
