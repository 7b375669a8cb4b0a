"""The Ray cloud's capacity model, measured on this machine (docs/scale-out.md).

    PYTHONPATH=src python benchmarks/scale_out_capacity.py [--model default] [--stages 1,2] [--json]

For the bundled model's cloud shard split into S stages (fp32, CPU, 1 torch thread per stage, as
`serve-cloud --ray` runs them): the compute time of one stage's pass (decoding steps of B sessions,
one row each, over a 64-entry context; a 256-row prefill chunk) and so its tokens/s; the KV bytes
per cache entry a stage holds; and the cost of one Ray hop (a pass's activations and description
sent to an actor that returns them, as stage 0 sends them to stage 1) on a local Ray instance.
Results: a table on stdout and benchmarks/results/scale-out-capacity-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from splitlm.bench.setup import BenchConfig, resolve_split  # noqa: E402
from splitlm.cloud.ray_stage import PassMeta, load_stage, stage_ranges  # noqa: E402
from splitlm.model.kv_cache import KVCache  # noqa: E402
from splitlm.model.loading import resolve_model  # noqa: E402
from splitlm.model.shards import Manifest  # noqa: E402
from splitlm.result_files import begin_run, write_result  # noqa: E402

CONTEXT = 64
CHUNK = 256
REPEATS = 7


def timed(fn, repeats: int = REPEATS) -> float:
    """The fastest of `repeats` calls of fn(), in seconds (after one warm-up call): on a shared machine
    the least disturbed run is the closest to the work's own cost."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.inference_mode()
def stage_pass(model, batch: int, rows: int, d: int):
    """A pass of `batch` sessions with `rows` new rows each after a CONTEXT-entry cache: a callable."""
    caches = [KVCache(len(model.middle.layers)) for _ in range(batch)]
    for c in caches:
        model.middle.forward_packed([torch.randn(1, CONTEXT, d)], [torch.arange(CONTEXT)], [None], [c])
    xs = [torch.randn(1, rows, d) for _ in range(batch)]
    pos = [torch.arange(CONTEXT, CONTEXT + rows) for _ in range(batch)]

    @torch.inference_mode()
    def run():
        for c in caches:
            c.crop(CONTEXT)
        model.middle.forward_packed(xs, pos, [None] * batch, caches)

    return run, xs, pos


class Echo:
    """An actor that returns the activations it is sent: what a hop costs without any compute."""

    def run(self, meta: PassMeta, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return xs


def ray_hop(batch: int, d: int) -> dict:
    """The fastest round trip of a decoding pass's activations and description (`batch` sessions, one row each)
    to an actor and back, as `PipelineStack` sends them (a `PassMeta` in the object store, then the call)."""
    import ray

    echo = ray.remote(Echo).options(num_cpus=0).remote()
    sids = list(range(1, batch + 1))
    xs = [torch.randn(1, 1, d) for _ in sids]
    meta = PassMeta(
        sids, [False] * batch, [[("pending", CONTEXT)] for _ in sids], [torch.tensor([CONTEXT])] * batch, [None] * batch
    )
    hop = timed(lambda: ray.get(echo.run.remote(ray.put(meta), xs)), 21)
    ray.kill(echo)
    return {"batch": batch, "hop_ms": round(hop * 1000, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--stages", default="1,2", help="stage counts to measure (comma-separated)")
    p.add_argument("--batches", default="1,8,16", help="decoding sessions per pass (comma-separated)")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray hop measurement")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    begin_run()
    torch.set_num_threads(1)
    split, _ = resolve_split(BenchConfig(model=args.model), resolve_model(args.model))
    shard = split / "cloud"
    manifest = Manifest.read(shard, "cloud")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for stages in [int(s) for s in args.stages.split(",")]:
        lo, hi = stage_ranges(*manifest.cloud_layers, stages)[0]  # the first (largest) stage
        model = load_stage(shard, lo, hi, torch.device("cpu"), torch.float32)
        cfg = model.cfg
        d = cfg.hidden_size
        kv_entry = 2 * (hi - lo) * cfg.num_kv_heads * cfg.head_dim * 4
        for b in batches:
            run, _, _ = stage_pass(model, b, 1, d)
            s = timed(run)
            rows.append(
                {
                    "stages": stages,
                    "layers": hi - lo,
                    "kind": "decode",
                    "sessions": b,
                    "rows": b,
                    "pass_ms": round(s * 1000, 2),
                    "tok_s": round(b / s, 1),
                    "kv_bytes_per_entry": kv_entry,
                }
            )
        run, _, _ = stage_pass(model, 1, CHUNK, d)
        s = timed(run, 3)
        rows.append(
            {
                "stages": stages,
                "layers": hi - lo,
                "kind": "prefill chunk",
                "sessions": 1,
                "rows": CHUNK,
                "pass_ms": round(s * 1000, 2),
                "tok_s": round(CHUNK / s, 1),
                "kv_bytes_per_entry": kv_entry,
            }
        )
    hops = []
    if not args.no_ray:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
        try:
            hops = [ray_hop(b, cfg.hidden_size) for b in batches]
        finally:
            ray.shutdown()
    doc = {
        "schema": "splitlm.scale-out-capacity/1",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()),
        "model": args.model,
        "cloud_layers": list(manifest.cloud_layers),
        "context": CONTEXT,
        "cpu_count": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "stage_passes": rows,
        "ray_hops": hops,
    }
    path = write_result(
        Path("benchmarks") / "results", "scale-out-capacity", doc, stamp=doc["started"].replace(":", "")
    ).json
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print("| stages | layers per stage | pass | rows | pass ms | tok/s per stage | KV bytes per entry per stage |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['stages']} | {r['layers']} | {r['kind']} ({r['sessions']} sessions) | {r['rows']} | "
            f"{r['pass_ms']} | {r['tok_s']} | {r['kv_bytes_per_entry']} |"
        )
    if hops:
        print("\n| sessions per pass | Ray hop ms (activations to an actor and back) |\n|---|---|")
        for h in hops:
            print(f"| {h['batch']} | {h['hop_ms']} |")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
