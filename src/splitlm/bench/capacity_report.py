"""The capacity curve's figures, result document, Markdown table and plot (`splitlm.bench.capacity`)."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

from splitlm.bench import cloud_probe as m
from splitlm.bench.load_sessions import quantiles
from splitlm.bench.trace import Trace
from splitlm.result_files import write_result

MB = 2**20
SCHEMA = "splitlm.capacity/1"


def ratio(a: float, b: float, digits: int = 2) -> float | None:
    return round(a / b, digits) if b else None


def client_figures(edges, window) -> dict:
    """What the virtual edges measured in the window: replies that came in it."""
    t0, t1 = window.before.at, window.after.at
    samples = [s for e in edges for s in e.log.samples if t0 <= s.done <= t1]
    errors = [msg for e in edges for _, msg in e.log.errors]
    tokens = sum(s.accepted for s in samples)
    return {
        "tokens": tokens,
        "aggregate_tok_s": round(tokens / window.seconds, 2),
        "forwards": len(samples),
        "forwards_s": round(len(samples) / window.seconds, 2),
        "step_latency_ms": quantiles([s.latency_s for s in samples], 1000),
        "decode_latency_ms": quantiles([s.latency_s for s in samples if not s.prefill], 1000),
        "queue_ms": quantiles([s.queue_s for s in samples], 1000),
        "cloud_compute_ms": quantiles([s.compute_s for s in samples], 1000),
        "errors": len(errors),
        "error_messages": sorted(set(errors))[:5],
        "generations": sum(e.log.generations for e in edges),
    }


def cloud_figures(window) -> dict:
    """What the cloud counted in the window (its `/metrics`, differenced) and its state at the end."""
    a, b = window.before, window.after
    passes = b.delta(a, m.PASSES)
    return {
        "passes_s": round(passes / window.seconds, 2),
        "rows_per_pass": ratio(b.delta(a, m.PASS_ROWS), passes),
        "sessions_per_pass": ratio(b.delta(a, m.PASS_SESSIONS), passes),
        "pass_ms_mean": ratio(b.delta(a, m.PASS_SECONDS) * 1000, passes, 1),
        "pass_phase_ms_mean": {
            phase: ratio(b.delta(a, name) * 1000, passes, 1) for phase, name in m.PASS_PHASES.items()
        },
        "queue_ms_mean": ratio(b.delta(a, m.QUEUE_SECONDS) * 1000, b.delta(a, m.QUEUE_COUNT), 1),
        "cloud_errors": int(b.delta(a, m.ERRORS)),
        "cloud_sessions": b.value(m.SESSIONS),
        "kv_bytes": b.value(m.KV_BYTES),
        "cloud_rss_mb": round(b.rss / MB, 1),
    }


def point_figures(edges, window) -> dict:
    """One side of one point of the curve."""
    cloud_cpu = window.cloud_cpu_s
    return {
        **client_figures(edges, window),
        **cloud_figures(window),
        "seconds": round(window.seconds, 2),
        "cloud_cpu_s": round(cloud_cpu, 2),
        "client_cpu_s": round(window.client_cpu_s, 2),
        "wan_cpu_s": round(window.wan_cpu_s, 2),
        "cloud_cpu_util": round(cloud_cpu / window.seconds, 3),
        "client_cpu_share": ratio(window.client_cpu_s, window.client_cpu_s + cloud_cpu, 4),
    }


def cpu_shares(curve: list[dict], run_cpu: tuple[float, float, float]) -> dict:
    """The generator's share of the CPU seconds (it ÷ it + the cloud) over the measured windows and
    over the whole run; the WAN emulators' share of all three."""
    sides = [p[s] for p in curve for s in ("batched", "unbatched")]
    client, cloud, wan = (sum(s[k] for s in sides) for k in ("client_cpu_s", "cloud_cpu_s", "wan_cpu_s"))
    run_client, run_cloud, run_wan = run_cpu
    return {
        "client_cpu_share": ratio(client, client + cloud, 4),
        "client_cpu_share_max": max((s["client_cpu_share"] or 0 for s in sides), default=None),
        "client_cpu_share_run": ratio(run_client, run_client + run_cloud, 4),
        "wan_cpu_share": ratio(wan, client + cloud + wan, 4),
        "client_cpu_s": round(client, 1),
        "cloud_cpu_s": round(cloud, 1),
        "wan_cpu_s": round(wan, 1),
    }


def curve_doc(
    config,
    started: float,
    trace: Trace,
    trace_path: str,
    shards,
    curve: list[dict],
    run_cpu: tuple[float, float, float],
    cloud_args: dict,
) -> dict:
    for p in curve:
        p["speedup"] = ratio(p["batched"]["aggregate_tok_s"], p["unbatched"]["aggregate_tok_s"])
    return {
        "schema": SCHEMA,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)),
        "config": asdict(config),
        **cpu_shares(curve, run_cpu),
        "target": {
            "edge": str(shards.edge),
            "cloud": str(shards.cloud),
            "shape": config.shape or None,
            "cloud_device": config.cloud_device,
            "cloud_dtype": config.cloud_dtype,
            "cloud_args": cloud_args,
            "threads": "serve-cloud --threads 1; the generator: one "
            "thread per virtual edge, torch on 1 thread; one `splitlm wan` process per cloud",
        },
        "trace": {"path": trace_path, "edge": str(shards.trace_edge) if shards.trace_edge else None, **trace.summary()},
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "curve": curve,
    }


def markdown(doc: dict) -> str:
    lines = [
        "| sessions | cloud | tok/s | passes/s | rows / pass | sessions / pass | step p50 / p99 ms | "
        "queue p50 ms | RSS MB | KV MB | errors | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in doc["curve"]:
        for side in ("batched", "unbatched"):
            r = p[side]
            kv = None if r["kv_bytes"] is None else round(r["kv_bytes"] / MB, 1)
            lines.append(
                f"| {p['sessions']} | {side} | {r['aggregate_tok_s']} | {r['passes_s']} | {r['rows_per_pass']} |"
                f" {r['sessions_per_pass']} | {r['step_latency_ms']['p50']} / {r['step_latency_ms']['p99']} |"
                f" {r['queue_ms']['p50']} | {r['cloud_rss_mb']} | {kv} | {r['errors']} |"
                f" {r['client_cpu_share']} |"
            )
    speedups = ", ".join(f"{p['sessions']}: {p['speedup']}x" for p in doc["curve"])
    lines += [
        "",
        f"batched / --max-batch 1 aggregate tok/s by sessions: {speedups}",
        f"generator CPU share (measured windows): {doc['client_cpu_share']} (worst point "
        f"{doc['client_cpu_share_max']}; whole run {doc['client_cpu_share_run']}); WAN emulators' share "
        f"{doc['wan_cpu_share']}",
    ]
    return "\n".join(lines)


def write_plot(doc: dict, base: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = doc["curve"]
    ns = [p["sessions"] for p in curve]
    panels = [
        ("aggregate accepted tokens / s", lambda r: r["aggregate_tok_s"]),
        ("step latency p50 (solid) / p99 (dashed), ms", lambda r: r["step_latency_ms"]["p50"]),
        ("rows per pass", lambda r: r["rows_per_pass"]),
        ("cloud RSS, MB", lambda r: r["cloud_rss_mb"]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (title, get) in zip(axes.flat, panels, strict=True):
        for side, color in (("batched", "#4c78a8"), ("unbatched", "#f58518")):
            ax.plot(ns, [get(p[side]) for p in curve], "o-", color=color, label=side)
            if title.startswith("step"):
                ax.plot(ns, [p[side]["step_latency_ms"]["p99"] for p in curve], "s--", color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("concurrent sessions (virtual edges)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    t, c = doc["trace"], doc["config"]
    fig.suptitle(
        f"Cloud capacity: {c['shape'] or Path(doc['target']['edge']).parent.name} on "
        f"{c['cloud_device']} {c['cloud_dtype']}, RTT {c['rtt_ms']:g} ms, trace {t['prompts']} prompts "
        f"({t['tokens_per_forward']} tok/forward), max-batch {c['max_batch']} vs 1",
        fontsize=9,
    )
    fig.tight_layout()
    path = base.with_name(base.name + ".png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def write_capacity(doc: dict, out: str | Path) -> list[Path]:
    """`OUT/capacity-<stamp>.json`, `.md` and `.png`."""
    return write_result(
        out,
        "capacity",
        doc,
        stamp=doc["started"].replace("-", "").replace(":", "").replace("T", "-"),
        markdown=markdown(doc),
        plots=lambda base: write_plot(doc, base),
    ).paths
