"""Micro-benchmark of the KV cache on the bundled model: per speculative step, T new tokens over a
context, then keep of a few of them (what a verified step does), for the edge's 4 layers and the
cloud's 26 (SmolLM2-135M). The context is cropped back after each step (not timed) or, with
"S grows", keeps growing by `keep` per step. One thread; prints CPU ms per step (process time:
less sensitive than wall time to other work on a shared machine).

    PYTHONPATH=src python benchmarks/kv_cache_step.py [--steps 200] [--t 8] [--keep 3] [--context 500]
"""

from __future__ import annotations

import argparse
import time

import torch

from splitlm.model.kv_cache import KVCache
from splitlm.model.llama import LayerStack
from splitlm.model.loading import load_model, load_state, resolve_model


def bench(stack: LayerStack, steps: int, t: int, keep: int, context: int, chain: bool, grow: bool) -> float:
    d = stack.cfg.hidden_size
    torch.manual_seed(0)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    kept = list(range(keep)) if chain else list(range(t - keep, t))  # chain: a prefix; else later entries move
    with torch.inference_mode():
        cache = stack.new_cache()
        stack(torch.randn(1, context, d), torch.arange(context), None, cache)
        x = torch.randn(1, t, d)
        total = 0.0
        for _ in range(steps):
            n = cache.length
            pos = torch.arange(n, n + t)
            t0 = time.process_time()
            stack(x, pos, mask, cache)
            cache.keep(kept)
            total += time.process_time() - t0
            if not grow:
                cache.crop(context)
    return total / steps * 1e3


def bench_cache(cfg, layers: int, steps: int, t: int, keep: int, context: int) -> float:
    """The cache's own work per step (begin, `layers` updates, keep), without the model."""
    shape = (1, cfg.num_kv_heads, t, cfg.head_dim)
    cache = KVCache(layers)
    cache.begin(context, torch.arange(context))
    for i in range(layers):
        cache.update(i, torch.randn(*shape[:2], context, shape[3]), torch.randn(*shape[:2], context, shape[3]))
    k, v, kept = torch.randn(shape), torch.randn(shape), list(range(t - keep, t))
    total = 0.0
    for _ in range(steps):
        pos = torch.arange(cache.length, cache.length + t)
        t0 = time.process_time()
        cache.begin(t, pos)
        for i in range(layers):
            cache.update(i, k, v)
        cache.keep(kept)
        total += time.process_time() - t0
        cache.crop(context)
    return total / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--t", type=int, default=8)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg, state = load_model("default")[0].cfg, load_state(resolve_model("default"))
    for name, (a, b) in {"edge 4 layers": (0, 4), "cloud 26 layers": (4, 30)}.items():
        stack = LayerStack(cfg, a, b).eval()
        stack.load_global_state(state)
        for chain, grow in ((True, False), (False, False), (False, True)):
            runs = [bench(stack, args.steps, args.t, args.keep, args.context, chain, grow) for _ in range(args.repeats)]
            kind = ("keep prefix" if chain else "keep moved") + (", S grows" if grow else "")
            print(
                f"{name:16s} {kind:22s} T={args.t} keep={args.keep} S={args.context}: "
                f"best {min(runs):.3f} ms/step (runs {', '.join(f'{r:.3f}' for r in runs)})"
            )
        runs = [bench_cache(cfg, b - a, args.steps, args.t, args.keep, args.context) for _ in range(args.repeats)]
        print(
            f"{name:16s} {'cache ops only':22s} T={args.t} keep={args.keep} S={args.context}: "
            f"best {min(runs):.3f} ms/step (runs {', '.join(f'{r:.3f}' for r in runs)})"
        )


if __name__ == "__main__":
    main()
