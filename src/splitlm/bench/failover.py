"""Failover under injected link cuts: consecutive generations through the WAN emulator, each one's
link cut once at a random byte of its traffic; every output is compared with the undisturbed run,
and the time each cut cost is measured.

    python -m splitlm.bench.failover --rtt-ms 50 --runs 20 --out benchmarks/results/failover.json

`time lost` per failover: the interrupted step's stall (its first send to its reply after the
replay: the time until the cut was seen, the reconnect, the new session and the replayed context)
less the mean time of the run's other steps (what the step would have taken anyway). It is
measured inside one run, so it holds on a busy machine where whole runs' wall times vary by
seconds. `failover_s` is the part from the fault seen to the replayed requests sent."""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from splitlm.bench.wan import WanConfig, WanEmulator
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.sampling import SamplingConfig
from splitlm.result_files import begin_run, write_result

log = logging.getLogger(__name__)

# (name, spec, sampling): sequential and pipelined speculation, greedy and seeded sampling
CASES = [
    ("greedy ngram", SpecConfig("ngram"), None),
    ("greedy ngram pipelined", SpecConfig("ngram", pipeline=True), None),
    ("seeded ngram", SpecConfig("ngram"), SamplingConfig(temperature=0.8, seed=11)),
    ("seeded none", SpecConfig("none"), SamplingConfig(temperature=0.8, seed=11)),
]


@dataclass
class CutRun:
    case: str
    cut_after_bytes: int
    identical: bool
    failovers: int
    failover_s: float
    stall_s: float
    wall_s: float
    lost_s: float  # stall_s less the run's mean step time


def cut_runs(edge, wan: WanEmulator, prompt: str | list[int], runs: int, max_new_tokens: int = 32,
             cases=CASES, repeats: int = 3, seed: int = 0, chat: bool = False) -> dict:
    """`runs` generations through `wan` (which `edge` connects to), cycling through `cases`; each
    cut once at a random byte of the undisturbed traffic of its case. Returns a report."""
    rng = random.Random(seed)
    edge.generate(prompt, 4, chat=chat)  # warm-up (first-call costs stay out of the references)
    ref: dict[str, tuple[list[int], float, int]] = {}
    for name, spec, sampling in cases:
        walls, ids, size = [], None, 0
        for _ in range(repeats):
            before = wan.bytes_up + wan.bytes_down
            t0 = time.perf_counter()
            r = edge.generate(prompt, max_new_tokens, chat=chat, stop_at_eos=False, spec=spec, sampling=sampling)
            walls.append(time.perf_counter() - t0)
            size = min(size or 2**62, wan.bytes_up + wan.bytes_down - before)  # trees vary with the timing
            if ids is not None and r.token_ids != ids:
                raise RuntimeError(f"case {name}: two undisturbed runs differ; cannot judge the cut runs")
            ids = r.token_ids
        ref[name] = (ids, statistics.median(walls), size)
        log.info("undisturbed %s: %.3f s, %d bytes", name, ref[name][1], size)
    out: list[CutRun] = []
    for i in range(runs):
        name, spec, sampling = cases[i % len(cases)]
        ids, wall_ref, size = ref[name]
        cut = rng.randrange(1, int(size * 0.95))  # within the traffic of the case's runs
        while True:  # a run whose trees came out smaller may end before the cut: run it again, cut earlier
            cuts = wan.cuts
            wan.cut_after(cut)
            t0 = time.perf_counter()
            r = edge.generate(prompt, max_new_tokens, chat=chat, stop_at_eos=False, spec=spec, sampling=sampling)
            wall = time.perf_counter() - t0
            wan.cut_after(None)
            if wan.cuts > cuts:
                break
            log.info("run %d ended before its cut at %d bytes; again, cut at half of that", i, cut)
            if r.token_ids != ids:
                raise RuntimeError(f"run {i}: an uncut run differs from the undisturbed one")
            cut = max(1, cut // 2)
        s = r.stats
        step = (wall - s.failover_stall_s) / max(1, s.round_trips - s.failovers)  # the other steps' mean
        lost = s.failover_stall_s - s.failovers * step
        out.append(CutRun(name, cut, r.token_ids == ids, s.failovers, round(s.failover_s, 4),
                          round(s.failover_stall_s, 4), round(wall, 4), round(lost, 4)))
        log.info("run %d (%s): cut after %d bytes, %s, %.3f s lost (undisturbed run %.2f s, this one %.2f s)", i,
                 name, cut, "identical" if out[-1].identical else "DIFFERENT", lost, wall_ref, wall)
    lost = [r.lost_s for r in out if r.failovers]
    spent = [r.failover_s for r in out if r.failovers]
    return {
        "runs": [asdict(r) for r in out],
        "identical": sum(r.identical for r in out),
        "total": len(out),
        "failovers": sum(r.failovers for r in out),
        "median_lost_s": round(statistics.median(lost), 4) if lost else None,
        "max_lost_s": round(max(lost), 4) if lost else None,
        "median_failover_s": round(statistics.median(spent), 4) if spent else None,
        "max_failover_s": round(max(spent), 4) if spent else None,
        "undisturbed": {name: {"wall_s": round(w, 4), "bytes": b, "tokens": len(ids)}
                        for name, (ids, w, b) in ref.items()},
    }


def main(argv: list[str] | None = None) -> int:
    from splitlm.cloud.local import cloud_process
    from splitlm.edge import Edge
    from splitlm.model.shards import cached_split

    p = argparse.ArgumentParser(prog="python -m splitlm.bench.failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="undisturbed runs per case")
    p.add_argument("--prompt", default="List the planets of the solar system, one per line.")
    p.add_argument("--ping-interval", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=None, help="write the report (JSON) here; the summary goes to stderr")
    args = p.parse_args(argv)
    begin_run(None if argv is None else ["python", "-m", "splitlm.bench.failover", *argv])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    split = cached_split(args.model)
    with cloud_process(split / "cloud", "cpu", "fp32") as port, \
            WanEmulator(("127.0.0.1", port), WanConfig(rtt_ms=args.rtt_ms, seed=1)) as wan, \
            Edge(split / "edge", wan.url_for("ws"), wire_dtype="fp32", device="cpu", dtype="fp32",
                 ping_interval_s=args.ping_interval) as edge:
        report = cut_runs(edge, wan, args.prompt, args.runs, args.max_new_tokens, repeats=args.repeats, chat=True)
    report.update(model=args.model, rtt_ms=args.rtt_ms, max_new_tokens=args.max_new_tokens,
                  repeats=args.repeats, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    if args.out:  # out/NAME.json, NAME from --out (unstamped: a fixed name the docs cite)
        write_result(args.out.parent, args.out.stem, report)
    log.info("%s", json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0 if report["identical"] == report["total"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
