"""Where a cloud pass spends its time on a GPU: wall time against the time kernels keep the device busy,
and the kernel launches, for one session's pass and for a batched pass of many sessions
(`LayerStack.forward_packed`: rows packed for the dense layers; attention per session on its own cache,
or one padded call for all of them, `splitlm.model.padded`; both are timed).

    python benchmarks/gpu_profile.py --shape llama3-8b --device cuda --dtype bf16 --out DIR

Random weights of the shape are made on the device (`splitlm.bench.passcost.middle_layers`). Writes
gpu-profile-<shape>-<device type>-<stamp>.json and prints a table."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from splitlm.bench.passcost import median_ms, middle_layers, sync
from splitlm.model.synthetic import SHAPES


@torch.inference_mode()
def one_case(stack, device: torch.device, sessions: int, rows: int, context: int, reps: int, padded: bool) -> dict:
    """`sessions` sessions, each with `context` cached rows, send `rows` new rows each in one pass
    (`padded`: one attention call for all of them)."""
    stack.pad_attention = padded
    d = stack.cfg.hidden_size
    gen = torch.Generator(device).manual_seed(0)
    caches = []
    for _ in range(sessions):
        cache = stack.new_cache()
        stack(
            torch.randn(1, context, d, device=device, generator=gen), torch.arange(context, device=device), None, cache
        )
        caches.append(cache)
    xs = [torch.randn(1, rows, d, device=device, generator=gen) for _ in range(sessions)]  # [1, T, D] each
    pos = [torch.arange(context, context + rows, device=device) for _ in range(sessions)]

    def run() -> None:
        for cache in caches:
            cache.crop(context)
        stack.forward_packed(xs, pos, [None] * sessions, caches)

    wall_ms = median_ms(run, device, reps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        sync(device)
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    return {
        "sessions": sessions,
        "rows_per_session": rows,
        "context": context,
        "attention": "padded" if padded and sessions > 1 else "per sequence",
        "wall_ms": round(wall_ms, 2),
        "kernel_ms": round(kernel_us / 1000, 2),
        "device_busy": round(kernel_us / 1000 / wall_ms, 3),
        "kernel_launches": launches,
        "aten_calls": aten,
        "top": [
            (e.key[:80], round(e.self_device_time_total / 1000, 2), e.count)
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:8]
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--cases", default="1x1,1x8,1x64,8x23,32x23,64x23", help="SESSIONSxROWS, comma-separated")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    stack = middle_layers(SHAPES[args.shape], device, dtype)
    rows = []
    print("| sessions × rows | attention | wall ms | kernels busy ms | busy share | launches | aten calls |")
    print("|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        s, r = (int(x) for x in case.split("x"))
        for padded in (False, True) if s > 1 else (False,):
            row = one_case(stack, device, s, r, args.context, args.reps, padded)
            rows.append(row)
            print(
                f"| {s} × {r} | {row['attention']} | {row['wall_ms']} | {row['kernel_ms']} | {row['device_busy']} | "
                f"{row['kernel_launches']} | {row['aten_calls']} |",
                flush=True,
            )
    doc = {
        "schema": "splitlm.gpu-profile/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "shape": args.shape,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": args.dtype,
        "layers": len(stack.layers),
        "torch": torch.__version__,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu-profile-{args.shape}-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    for row in rows:
        print(row["sessions"], "x", row["rows_per_session"], row["attention"], "top:", row["top"][:4])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
