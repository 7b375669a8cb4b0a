"""`splitlm bench --edge-profiles`: the edge's peak memory and compute per step in each profile.

    torch-fp32   the torch edge in fp32 (the reference: token-identical to the full model)
    torch-bf16   the torch edge in bf16
    onnx-fp32    `--device onnx`: the graphs of `splitlm export-onnx` in ONNX Runtime (CPU)
    onnx-int8    `--device onnx:int8`: the same with dynamically quantised int8 weights

One cloud (fp32, in this process, no emulated WAN: the figures are the edge's) serves every profile;
each profile runs in a fresh child process, so its peak RSS (VmHWM) is its own. A child loads the edge
and then, on the same prompts:
  - generates greedily (`--spec none`, then `auto`), every token: are they the reference's tokens?
  - feeds the reference's continuation teacher-forced in one forward: the share of positions
    whose greedy token is the reference's (agreement);
  - times the edge's own compute per step without the network: head + tail + LM head for a decode
    step (1 token) and a tree step (16 tokens) after a 256-token context, the median of repeats;
  - reports the edge's compute per round trip in the generations (`GenerationStats.edge_compute_s`).
The ONNX graphs are exported into a private copy of the edge shard first (the export's time is reported).

    python -m splitlm.bench.edge_profiles < spec.json   # a child: prints one JSON line
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger(__name__)

PROFILES = {
    "torch-fp32": ("cpu", "fp32"),
    "torch-bf16": ("cpu", "bf16"),
    "onnx-fp32": ("onnx", "auto"),
    "onnx-int8": ("onnx:int8", "auto"),
}
CONTEXT, TREE, REPS = 256, 16, 7
MiB = 2**20


def step_seconds(model, cfg, t: int, context: int = CONTEXT, reps: int = REPS) -> float:
    """Median seconds of one edge pass of t new tokens (head, tail, LM head) after `context` cached tokens."""
    import torch

    from splitlm.model.llama import causal_mask

    head, tail = model.head.new_cache(), model.tail.new_cache()
    ids = torch.randint(0, cfg.vocab_size, (1, context))
    pos = torch.arange(context)
    with torch.inference_mode():
        h = model.embed_and_head(ids, pos, None, head)
        model.tail_and_logits(h.float(), pos, None, tail, rows=[context - 1])
        times = []
        for _ in range(reps):
            new, p = torch.randint(0, cfg.vocab_size, (1, t)), torch.arange(context, context + t)
            start = time.perf_counter()
            h = model.embed_and_head(new, p, causal_mask(t), head)
            model.tail_and_logits(h.float(), p, causal_mask(t), tail)
            times.append(time.perf_counter() - start)
            head.crop(context)
            tail.crop(context)
    return statistics.median(times)


def _child() -> None:
    spec = json.loads(sys.stdin.read())
    import torch

    import splitlm.edge  # noqa: F401  (imports before the baseline)
    from splitlm.bench.memory import current_rss_bytes, peak_rss_bytes

    torch.set_num_threads(spec["threads"])
    baseline = current_rss_bytes()
    from splitlm.decoding.step import StepInput
    from splitlm.edge import Edge, EdgeConfig

    out: dict = {}
    with Edge(spec["edge_dir"], spec["cloud_url"], EdgeConfig(device=spec["device"], dtype=spec["dtype"])) as edge:
        loaded = current_rss_bytes()
        prompts = [edge.text.encode(p["prompt"], chat=p["chat"]) for p in spec["prompts"]]
        edge_s = {"none": [0.0, 0], "auto": [0.0, 0]}
        for mode in ("none", "auto"):
            tokens = []
            for ids in prompts:
                r = edge.generate(ids, spec["max_new_tokens"], spec=mode, stop_at_eos=False)
                tokens.append(r.token_ids)
                edge_s[mode][0] += r.stats.edge_compute_s
                edge_s[mode][1] += r.stats.round_trips
            out[f"tokens_{mode}"] = tokens
        reference = spec.get("reference") or out["tokens_none"]
        hits = total = 0
        for ids, cont in zip(prompts, reference, strict=True):
            session = edge.open_session()
            try:
                logits = session.forward(StepInput(ids + cont[:-1])).out  # [T, V], one round trip
            finally:
                session.close()
            predicted = logits[len(ids) - 1 :].argmax(-1).tolist()
            hits += sum(a == b for a, b in zip(predicted, cont, strict=True))
            total += len(cont)
        out.update(
            teacher_forced={"hits": hits, "total": total, "agreement": round(hits / total, 4)},
            edge_compute_per_round_trip_ms={m: round(1000 * s / max(1, n), 2) for m, (s, n) in edge_s.items()},
            step_ms={
                "decode_1": round(1000 * step_seconds(edge.model, edge.cfg, 1), 2),
                f"tree_{TREE}": round(1000 * step_seconds(edge.model, edge.cfg, TREE), 2),
            },
        )
    peak = peak_rss_bytes()
    out.update(
        peak_rss_mb=round(peak / MiB, 1),
        baseline_rss_mb=round(baseline / MiB, 1),
        loaded_rss_mb=round(loaded / MiB, 1),
        added_peak_mb=round((peak - baseline) / MiB, 1),
    )
    sys.stdout.write(json.dumps(out) + "\n")  # the child's result: one JSON line that run_profile reads


def run_profile(
    name: str,
    edge_dir: Path,
    url: str,
    prompts: list[dict],
    max_new_tokens: int,
    threads: int,
    reference: list[list[int]] | None,
    timeout_s: float = 1800,
) -> dict:
    device, dtype = PROFILES[name]
    spec = {
        "edge_dir": str(edge_dir),
        "cloud_url": url,
        "device": device,
        "dtype": dtype,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "reference": reference,
    }
    env = {**os.environ, "SPLITLM_ONNX_THREADS": str(threads)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "splitlm.bench.edge_profiles"],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"profile {name} timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not proc.stdout.strip():
        return {"error": (proc.stderr.strip().splitlines() or ["profile failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def private_edge(edge_dir: Path, root: Path) -> Path:
    """A copy of the edge shard (weights linked, not copied) that the export may write into."""
    copy = root / "edge"
    shutil.copytree(edge_dir, copy, copy_function=os.symlink, ignore=shutil.ignore_patterns("onnx"))
    return copy


def edge_profiles_doc(split_dir: Path, prompts: list[dict], max_new_tokens: int, threads: int) -> dict:
    from splitlm.cloud.server import BackgroundServer
    from splitlm.model.onnx_export import export_edge_onnx, graph_file
    from splitlm.model.shards import load_edge

    rows = {}
    with tempfile.TemporaryDirectory(prefix="splitlm-edge-profiles-") as tmp:
        edge_dir = private_edge(split_dir / "edge", Path(tmp))
        start = time.perf_counter()
        export_edge_onnx(load_edge(edge_dir), edge_dir, int8=True)
        export_s = time.perf_counter() - start
        sizes = {p: sum(graph_file(edge_dir, s, p).stat().st_size for s in ("head", "tail")) for p in ("fp32", "int8")}
        log.info(f"[bench] exported the ONNX graphs in {export_s:.1f} s")
        with BackgroundServer(split_dir / "cloud") as server:
            reference = None
            for name in PROFILES:
                log.info(f"[bench] profile {name} ...")
                row = run_profile(name, edge_dir, server.url, prompts, max_new_tokens, threads, reference)
                if reference is None and "error" not in row:
                    reference = row["tokens_none"]
                rows[name] = row
    ref = rows["torch-fp32"]
    for name, row in rows.items():
        if "error" in row or "error" in ref:
            continue
        for mode in ("none", "auto"):
            row[f"identical_{mode}"] = row[f"tokens_{mode}"] == ref[f"tokens_{mode}"]
            row[f"same_tokens_{mode}"] = round(
                sum(
                    a == b
                    for x, y in zip(row[f"tokens_{mode}"], ref[f"tokens_{mode}"], strict=True)
                    for a, b in zip(x, y, strict=True)
                )
                / sum(map(len, ref[f"tokens_{mode}"])),
                4,
            )
        row["weights_on_disk_mb"] = round(sizes[name[5:]] / MiB, 1) if name.startswith("onnx") else None
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "split": str(split_dir),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "onnx_export_s": round(export_s, 1),
        "context_tokens": CONTEXT,
        "tree_tokens": TREE,
        "reference": "torch-fp32 greedy (spec none); teacher-forced agreement is against it",
        "profiles": rows,
    }


def markdown(doc: dict) -> str:
    lines = [
        "| profile | peak RSS MiB | added MiB | decode step ms | 16-token tree ms | edge ms / round trip "
        "(none, auto) | teacher-forced agreement | identical (none, auto) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in doc["profiles"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | | | | | |")
            continue
        e = r["edge_compute_per_round_trip_ms"]
        lines.append(
            f"| {name} | {r['peak_rss_mb']:.0f} | {r['added_peak_mb']:.0f} | {r['step_ms']['decode_1']:.1f} | "
            f"{r['step_ms'][f'tree_{TREE}']:.1f} | {e['none']:.1f}, {e['auto']:.1f} | "
            f"{r['teacher_forced']['agreement']:.4f} | {r.get('identical_none')}, {r.get('identical_auto')} |"
        )
    return "\n".join(lines)


def tuning_prompts(prompts_file: str = "", limit: int | None = None) -> list[dict]:
    """The first `limit` (default 8) prompts of `prompts_file`, else of benchmarks/prompts-tuning.json."""
    from splitlm.bench.prompts import load_prompts

    path = Path(prompts_file) if prompts_file else Path(__file__).parents[3] / "benchmarks" / "prompts-tuning.json"
    return [{"prompt": p.prompt, "chat": p.chat} for p in load_prompts(path)][: limit or 8]


def write_results(doc: dict, out: str | Path) -> list[Path]:
    """Write `edge-profiles-<stamp>.json`; returns its path in a list."""
    from splitlm.result_files import time_stamp, write_result

    return write_result(out, "edge-profiles", doc, stamp=time_stamp(doc["created"])).paths


if __name__ == "__main__":
    _child()
