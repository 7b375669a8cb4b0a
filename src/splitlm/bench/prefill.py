"""`splitlm bench --prefill`: time to first token, streamed prefill vs one forward, behind an emulated WAN.

    splitlm bench --prefill                                  # 64 … 4,096 tokens at 80 ms, 100 and 10 Mbit/s
    splitlm bench --prefill --prefill-lengths 2048 --prefill-mbps 100 --repeats 3

Set-up as `splitlm bench`: the cloud shard is served by a `splitlm serve-cloud --threads 1`
subprocess; the edge runs in this process with one torch thread; each bandwidth has its own WAN
emulator (a thread of this process) and its own edge, whose measured costs plan the chunks. Each
edge first warms up (a few decoding steps for the RTT, a prompt of 512 tokens each way). Then, for
every prompt length and bandwidth in turn, the same prompt (text of Python's pydoc topics) is
prefilled unchunked and streamed, in alternating order, and decodes three more greedy tokens.

TTFT is the prefill forward (`EdgeSession.forward` of the prompt, the last row's greedy token),
as `Edge.generate` runs it. Next to it, the bound of a pipeline, from the components measured in
that same streamed run: the slowest stage's total, plus one chunk (its average) through each of
the others, plus the RTT. Stages: edge (head and tail compute, frame encoding), uplink and downlink
(bytes sent / the emulated bandwidth), cloud (the `compute_s` its RESULTs report). For the
unchunked run the same sum with one chunk is the stages one after another.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from splitlm import SplitLMError, __version__
from splitlm.decoding.step import StepInput

log = logging.getLogger(__name__)

SCHEMA = "splitlm.bench.prefill/1"
DEFAULT_OUT = Path("benchmarks") / "prefill"
DEFAULT_LENGTHS = [64, 128, 256, 512, 1024, 2048, 4096]
DECODE_TOKENS = 3  # greedy tokens after the first, to check the streamed cache


@dataclass
class PrefillBenchConfig:
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    mbps: list[float] = field(default_factory=lambda: [100.0, 10.0])
    rtt_ms: float = 80.0
    repeats: int = 1
    model: str = "default"
    head: int = 2
    tail: int = 2
    wire_dtype: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    cloud_device: str | None = None
    cloud_dtype: str | None = None
    out: str = str(DEFAULT_OUT)


def prompt_ids(tokenizer, n: int) -> list[int]:
    """The first `n` tokens of Python's pydoc topics (text every Python has)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    if len(ids) < n:
        raise SplitLMError(f"the pydoc topics give {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def stage_totals(edge_s: float, cloud_s: float, bytes_up: int, bytes_down: int, mbps: float) -> dict[str, float]:
    return {
        "edge": edge_s,
        "uplink": bytes_up * 8 / (mbps * 1e6),
        "cloud": cloud_s,
        "downlink": bytes_down * 8 / (mbps * 1e6),
    }


def pipeline_bound(stages: dict[str, float], chunks: int, rtt_s: float) -> tuple[float, str]:
    """(seconds, the slowest stage): its total, plus one chunk through each of the others, plus the RTT."""
    slowest = max(stages, key=stages.get)
    return stages[slowest] + sum(v for k, v in stages.items() if k != slowest) / chunks + rtt_s, slowest


def run_once(edge, ids: list[int], streamed: bool, mbps: float, rtt_s: float) -> dict:
    """Prefill `ids` in a fresh session (streamed per the edge's plan, or in one forward), then decode a few tokens."""
    edge.prefill_chunk = "auto" if streamed else 0
    session = edge.open_session()
    try:
        start = time.perf_counter()
        first = int(session.forward(StepInput(ids, rows=[len(ids) - 1], argmax=True)).out[-1])
        ttft = time.perf_counter() - start
        s = session.stats
        row = {
            "mode": "streamed" if streamed else "unchunked",
            "ttft_s": ttft,
            "rtt_s": rtt_s,
            "round_trips": s.round_trips,
            "bytes_up": s.bytes_up,
            "bytes_down": s.bytes_down,
        }
        run = session.last_prefill if streamed else None
        if run is not None:
            edge_s = sum(c.head_s + c.tail_s for c in run.chunks)
            cloud_s = sum(c.cloud_s for c in run.chunks)
            row.update(
                chunk=run.chunk,
                chunks=len(run.chunks),
                predicted_s=run.predicted_s,
                unchunked_predicted_s=run.unchunked_predicted_s,
            )
        else:  # the unchunked path (or a prompt the plan keeps whole)
            edge_s, cloud_s = s.edge_compute_s + s.serialize_s, s.cloud_compute_s
            row.update(chunk=len(ids), chunks=s.round_trips, predicted_s=None, unchunked_predicted_s=None)
        stages = stage_totals(edge_s, cloud_s, s.bytes_up, s.bytes_down, mbps)
        if run is not None:
            bound, slowest = pipeline_bound(stages, row["chunks"], rtt_s)
        else:  # the stages one after another; forwards one after another (over the cloud's tokens per forward)
            bound, slowest = sum(stages.values()) + rtt_s * s.round_trips, max(stages, key=stages.get)
        row.update(stages_s=stages, bound_s=bound, slowest=slowest)
        tokens = [first]
        for _ in range(DECODE_TOKENS):
            tokens.append(int(session.forward(StepInput([tokens[-1]], argmax=True)).out[-1]))
        row["tokens"] = tokens
        if run is not None:
            row["chunk_log"] = [asdict(c) for c in run.chunks]
        return row
    finally:
        session.close()


def warm_up(edge, ids: list[int], mbps: float, rtt_s: float) -> None:
    """Connect, measure the RTT (a few decoding steps), the bandwidth and the compute (512-token prompts)."""
    edge.generate(ids[:16], max_new_tokens=6, stop_at_eos=False)
    for streamed in (False, True):
        run_once(edge, ids[:512], streamed, mbps, rtt_s)


def run_prefill_bench(config: PrefillBenchConfig) -> dict:
    import torch

    from splitlm.bench.prompts import load_tokenizer
    from splitlm.bench.wan import WanConfig, WanEmulator
    from splitlm.cloud.local import cloud_process
    from splitlm.edge import Edge, EdgeConfig
    from splitlm.model.loading import resolve_model
    from splitlm.model.shards import cached_split

    torch.set_num_threads(1)
    model_dir = resolve_model(config.model)
    split_dir = cached_split(config.model, config.head, config.tail)
    ids = prompt_ids(load_tokenizer(model_dir), max(max(config.lengths), 512))
    rtt_s = config.rtt_ms / 1000
    started, load_at_start = time.time(), [round(x, 2) for x in os.getloadavg()]
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        cloud = (config.cloud_device or config.device, config.cloud_dtype or config.dtype)
        port = stack.enter_context(cloud_process(split_dir / "cloud", *cloud))
        edges = {}
        for mbps in config.mbps:
            wan = stack.enter_context(
                WanEmulator(upstream=("127.0.0.1", port), config=WanConfig(rtt_ms=config.rtt_ms, mbps=mbps, seed=0))
            )
            edges[mbps] = stack.enter_context(
                Edge(
                    split_dir / "edge",
                    wan.url_for("ws"),
                    EdgeConfig(wire_dtype=config.wire_dtype, device=config.device, dtype=config.dtype),
                )
            )
            log.info(f"[bench prefill] warm-up at {config.rtt_ms:g} ms, {mbps:g} Mbit/s")
            warm_up(edges[mbps], ids, mbps, rtt_s)
        first_edge = next(iter(edges.values()))
        for n in config.lengths:
            for mbps, edge in edges.items():
                for r in range(config.repeats):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    for streamed in order:
                        row = {
                            "tokens_in": n,
                            "mbps": mbps,
                            "repeat": r,
                            **run_once(edge, ids[:n], streamed, mbps, rtt_s),
                        }
                        rows.append(row)
                        log.info(
                            f"[bench prefill] {n:>5} tokens {mbps:>5g} Mbit/s {row['mode']:<9} TTFT "
                            f"{row['ttft_s'] * 1000:7.0f} ms  bound {row['bound_s'] * 1000:7.0f} ms "
                            f"({row['slowest']})  {row['chunks']} x {row['chunk']}"
                        )
        devices = {"edge": f"{first_edge.device} {first_edge.dtype}".replace("torch.", "")}
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "config": asdict(config),
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "splitlm": __version__,
            "threads": {"edge": 1, "cloud": 1, "wan_emulator": "thread of the bench process"},
            "model": model_dir.name,
            "split": {"head": config.head, "tail": config.tail},
            "wire_dtype": first_edge.wire_dtype,
            "devices": devices,
            "load_avg_at_start": load_at_start,
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "summary": summarise(rows),
        "runs": rows,
    }


def summarise(rows: list[dict]) -> list[dict]:
    """Per prompt length and bandwidth: median TTFT of each mode, the streamed run's bound, the ratios."""
    from statistics import median

    out = []
    keys = sorted({(r["mbps"], r["tokens_in"]) for r in rows}, key=lambda k: (-k[0], k[1]))
    for mbps, n in keys:
        group = [r for r in rows if r["mbps"] == mbps and r["tokens_in"] == n]
        streamed = [r for r in group if r["mode"] == "streamed"]
        unchunked = [r for r in group if r["mode"] == "unchunked"]
        s_ttft, u_ttft = median(r["ttft_s"] for r in streamed), median(r["ttft_s"] for r in unchunked)
        bound = median(r["bound_s"] for r in streamed)
        # the same bound from the unchunked runs' stage totals: what chunking and running the stages at
        # once (here: on shared cores) added to the work itself
        work = (
            {k: median(r["stages_s"][k] for r in unchunked) for k in unchunked[0]["stages_s"]}
            if all("stages_s" in r for r in unchunked)
            else None
        )
        ideal = pipeline_bound(work, streamed[0]["chunks"], streamed[0]["rtt_s"])[0] if work else None
        out.append(
            {
                "mbps": mbps,
                "tokens_in": n,
                "streamed_ttft_s": round(s_ttft, 4),
                "unchunked_ttft_s": round(u_ttft, 4),
                "bound_s": round(bound, 4),
                "streamed_over_bound": round(s_ttft / bound, 3),
                "speedup": round(u_ttft / s_ttft, 3),
                "chunk": streamed[0]["chunk"],
                "chunks": streamed[0]["chunks"],
                "slowest": streamed[0]["slowest"],
                "unchunked_sum_s": round(median(r["bound_s"] for r in unchunked), 4),
                "bound_from_unchunked_work_s": None if ideal is None else round(ideal, 4),
                "tokens_match": all(r["tokens"] == unchunked[0]["tokens"] for r in group),
            }
        )
    return out


def markdown(doc: dict) -> str:
    env, cfg = doc["environment"], doc["config"]
    lines = [
        f"# Streamed prefill, {doc['created']}",
        "",
        f"{env['model']}, split k={cfg['head']} m={cfg['tail']}, wire {env['wire_dtype']}, RTT {cfg['rtt_ms']:g} ms, "
        f"edge and cloud 1 torch thread each ({env['cpu_count']} cores, load {env['load_avg_at_start']} → "
        f"{env['load_avg_at_end']}); {cfg['repeats']} run(s) per cell, medians.",
        "",
        "| Mbit/s | prompt tokens | unchunked TTFT | streamed TTFT | bound | streamed / bound | speed-up | "
        "chunks × size | slowest stage | bound from unchunked work | same tokens |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in doc["summary"]:
        lines.append(
            f"| {r['mbps']:g} | {r['tokens_in']} | {r['unchunked_ttft_s'] * 1000:.0f} ms | "
            f"{r['streamed_ttft_s'] * 1000:.0f} ms | {r['bound_s'] * 1000:.0f} ms | "
            f"{r['streamed_over_bound']:.2f} | {r['speedup']:.2f}× | {r['chunks']} × {r['chunk']} | "
            f"{r['slowest']} | {fmt_ms(r.get('bound_from_unchunked_work_s'))} | "
            f"{'yes' if r['tokens_match'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def fmt_ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f} ms"


def write_results(doc: dict, out: str | Path) -> list[Path]:
    """Write `prefill-<stamp>.json` and `.md`; returns their paths."""
    from splitlm.result_files import time_stamp, write_result

    return write_result(out, "prefill", doc, stamp=time_stamp(doc["created"]), markdown=markdown(doc)).paths


def parse_list(text: str, what: str, cast) -> list:
    try:
        values = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SplitLMError(f"bad {what} {text!r}: expected numbers separated by commas") from None
    if not values or any(v <= 0 for v in values):
        raise SplitLMError(f"bad {what} {text!r}: expected numbers > 0 separated by commas")
    return values
