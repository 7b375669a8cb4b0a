"""Failover under injected faults: consecutive generations from one edge to two clouds, each behind its
own WAN emulator; each generation meets one fault at a random moment, its link cut (a reset in the
middle of the next message) or its cloud SIGKILLed, and its output is compared with the undisturbed run; the time each
fault cost is measured. Cuts and kills are counted apart.

    python -m splitlm.bench.failover --rtt-ms 80 --cuts 20 --kills 20 --out benchmarks/results/failover.json

`time lost` per failover: the interrupted step's stall (its first send to its reply after the
replay: the time until the fault was seen, the reconnect, the new session and the replayed context)
less the mean time of the run's other steps (what the step would have taken anyway). It is
measured inside one run, so it holds on a busy machine where whole runs' wall times vary by
seconds. `failover_s` is the part from the fault seen to the replayed requests sent. A killed cloud
is started again (on its port) after its run, outside the timing."""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from splitlm.bench.wan import WanConfig, WanEmulator
from splitlm.cloud.local import LocalCloud
from splitlm.decoding.modes import SpecConfig
from splitlm.decoding.sampling import SamplingConfig
from splitlm.progress import track
from splitlm.result_files import begin_run, write_result

log = logging.getLogger(__name__)

FAULTS = ("cut", "kill")
SEEDED = SamplingConfig(temperature=0.8, seed=11)


def cases_for(spec: str) -> list[tuple[str, SpecConfig, SamplingConfig | None]]:
    """(name, spec, sampling): greedy and seeded sampling with `spec`, and `spec` pipelined."""
    return [
        (f"greedy {spec}", SpecConfig(spec), None),
        (f"seeded {spec}", SpecConfig(spec), SEEDED),
        (f"greedy {spec} pipelined", SpecConfig(spec, pipeline=True), None),
    ]


@dataclass
class FaultRun:
    fault: str  # "cut": the link reset; "kill": the cloud SIGKILLed
    case: str
    at: float  # seconds into the run
    identical: bool
    failovers: int
    failover_s: float
    stall_s: float
    wall_s: float
    lost_s: float  # stall_s less the run's mean step time


class Rig:
    """Clouds of one shard, each behind its own emulated WAN: the edge is given all their URLs."""

    def __init__(self, clouds: list[LocalCloud], wans: list[WanEmulator]):
        self.clouds, self.wans = clouds, wans

    @property
    def urls(self) -> list[str]:
        return [w.url_for("ws") for w in self.wans]

    def traffic(self) -> list[int]:
        return [w.bytes_up + w.bytes_down for w in self.wans]

    def faults(self, fault: str) -> int:
        """The faults of this kind so far: links cut, or clouds killed."""
        return sum(w.cuts for w in self.wans) if fault == "cut" else sum(c.kills for c in self.clouds)

    def strike(self, fault: str, since: list[int]) -> None:
        """Cut the link (at its next byte) or kill the cloud that carried the most bytes `since`."""
        moved = [b - a for a, b in zip(since, self.traffic(), strict=True)]
        i = moved.index(max(moved))
        if fault == "cut":
            self.wans[i].cut_after(1)
        else:
            self.clouds[i].kill()

    def disarm(self) -> None:
        for w in self.wans:
            w.cut_after(None)

    def heal(self) -> None:
        """Every cloud serving again (a killed one restarted on its port)."""
        for cloud in self.clouds:
            cloud.start()


def _summary(runs: list[FaultRun]) -> dict:
    lost = [r.lost_s for r in runs if r.failovers]
    spent = [r.failover_s for r in runs if r.failovers]
    return {
        "identical": sum(r.identical for r in runs),
        "total": len(runs),
        "failovers": sum(r.failovers for r in runs),
        "median_lost_s": round(statistics.median(lost), 4) if lost else None,
        "max_lost_s": round(max(lost), 4) if lost else None,
        "median_failover_s": round(statistics.median(spent), 4) if spent else None,
        "max_failover_s": round(max(spent), 4) if spent else None,
    }


@dataclass
class FaultPlan:
    """`cuts` runs with a link cut and `kills` runs with the cloud killed, cycling through `cases`
    (name, spec, sampling), each against `repeats` undisturbed runs of its case; `seed` picks the
    faults' order and moments."""

    prompt: str | list[int]
    cuts: int
    kills: int
    cases: list[tuple[str, SpecConfig, SamplingConfig | None]]
    max_new_tokens: int = 32
    repeats: int = 2
    seed: int = 0
    chat: bool = False


def undisturbed(edge, plan: FaultPlan) -> dict[str, tuple[list[int], float]]:
    """Per case: its output and its quickest wall time of `plan.repeats` undisturbed runs (which must agree)."""
    edge.generate(plan.prompt, 4, chat=plan.chat)  # warm-up (first-call costs stay out of the references)
    ref: dict[str, tuple[list[int], float]] = {}
    for name, spec, sampling in plan.cases:
        walls, ids = [], None
        for _ in range(plan.repeats):
            t0 = time.perf_counter()
            r = edge.generate(
                plan.prompt, plan.max_new_tokens, chat=plan.chat, stop_at_eos=False, spec=spec, sampling=sampling
            )
            walls.append(time.perf_counter() - t0)
            if ids is not None and r.token_ids != ids:
                raise RuntimeError(f"case {name}: two undisturbed runs differ; cannot judge the faulty runs")
            ids = r.token_ids
        ref[name] = (ids, min(walls))
        log.info("undisturbed %s: %.3f s", name, ref[name][1])
    return ref


def fault_runs(edge, rig: Rig, plan: FaultPlan) -> dict:
    """Run `plan` with `edge` on `rig`'s clouds; returns a report."""
    rng = random.Random(plan.seed)
    prompt, chat, max_new_tokens, cases = plan.prompt, plan.chat, plan.max_new_tokens, plan.cases
    ref = undisturbed(edge, plan)
    order = [("cut", i) for i in range(plan.cuts)] + [("kill", i) for i in range(plan.kills)]
    rng.shuffle(order)
    out: list[FaultRun] = []
    for n, (fault, i) in enumerate(track(order, "faults", unit="run")):
        name, spec, sampling = cases[i % len(cases)]
        ids, wall_ref = ref[name]
        at = rng.uniform(0.05, 0.9) * wall_ref  # seconds into the run
        while True:  # a run that came out quicker may end before its fault: run it again, the fault earlier
            seen = rig.faults(fault)
            timer = threading.Timer(at, rig.strike, (fault, rig.traffic()))
            timer.start()
            t0 = time.perf_counter()
            r = edge.generate(prompt, max_new_tokens, chat=chat, stop_at_eos=False, spec=spec, sampling=sampling)
            wall = time.perf_counter() - t0
            timer.cancel()
            timer.join()
            rig.disarm()
            rig.heal()
            if rig.faults(fault) > seen:
                break
            log.info("run %d ended before its %s at %.2f s; again, the fault at half of that", n, fault, at)
            if r.token_ids != ids:
                raise RuntimeError(f"run {n}: a run without its fault differs from the undisturbed one")
            at /= 2
        s = r.stats
        step = (wall - s.failover_stall_s) / max(1, s.round_trips - s.failovers)  # the other steps' mean
        lost = s.failover_stall_s - s.failovers * step
        out.append(
            FaultRun(
                fault,
                name,
                round(at, 4),
                r.token_ids == ids,
                s.failovers,
                round(s.failover_s, 4),
                round(s.failover_stall_s, 4),
                round(wall, 4),
                round(lost, 4),
            )
        )
        log.info(
            "run %d (%s, %s at %.2f s): %s, %d failover(s), %.3f s lost (undisturbed %.2f s, this one %.2f s)",
            n,
            name,
            fault,
            at,
            "identical" if out[-1].identical else "DIFFERENT",
            s.failovers,
            lost,
            wall_ref,
            wall,
        )
    return {
        "runs": [asdict(r) for r in out],
        **{fault: _summary([r for r in out if r.fault == fault]) for fault in FAULTS},
        "identical": sum(r.identical for r in out),
        "total": len(out),
        "undisturbed": {name: {"wall_s": round(w, 4), "tokens": len(ids)} for name, (ids, w) in ref.items()},
    }


def main(argv: list[str] | None = None) -> int:
    from splitlm.edge import Edge, EdgeConfig
    from splitlm.model.shards import cached_split

    p = argparse.ArgumentParser(prog="python -m splitlm.bench.failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rtt-ms", type=float, default=80.0)
    p.add_argument("--cuts", type=int, default=20, help="runs whose link is cut")
    p.add_argument("--kills", type=int, default=20, help="runs whose cloud is killed")
    p.add_argument("--spec", default="auto", help="the speculation mode of every case (default: auto)")
    p.add_argument("--wire-dtype", default="auto", help="activations on the wire (default: auto)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="undisturbed runs per case")
    p.add_argument("--prompt", default="List the planets of the solar system, one per line.")
    p.add_argument("--ping-interval", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=None, help="write the report (JSON) here; the summary goes to stderr")
    args = p.parse_args(argv)
    begin_run(None if argv is None else ["python", "-m", "splitlm.bench.failover", *argv])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    split = cached_split(args.model)
    with tempfile.TemporaryDirectory(prefix="splitlm-failover-") as tmp:
        clouds = [LocalCloud(split / "cloud", Path(tmp) / f"cloud{i}.log", "cpu") for i in range(2)]
        try:
            for cloud in clouds:
                cloud.start()
            with (
                WanEmulator(("127.0.0.1", clouds[0].port), WanConfig(rtt_ms=args.rtt_ms, seed=1)) as wan0,
                WanEmulator(("127.0.0.1", clouds[1].port), WanConfig(rtt_ms=args.rtt_ms, seed=2)) as wan1,
            ):
                rig = Rig(clouds, [wan0, wan1])
                with Edge(
                    split / "edge",
                    rig.urls,
                    EdgeConfig(wire_dtype=args.wire_dtype, device="cpu", ping_interval_s=args.ping_interval),
                ) as edge:
                    plan = FaultPlan(
                        args.prompt,
                        args.cuts,
                        args.kills,
                        cases_for(args.spec),
                        args.max_new_tokens,
                        repeats=args.repeats,
                        chat=True,
                    )
                    report = fault_runs(edge, rig, plan)
        finally:
            for cloud in clouds:
                cloud.stop()
    report.update(
        model=args.model,
        rtt_ms=args.rtt_ms,
        spec=args.spec,
        wire_dtype=args.wire_dtype,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    if args.out:  # out/NAME.json, NAME from --out (unstamped: a fixed name the docs cite)
        write_result(args.out.parent, args.out.stem, report)
    log.info("%s", json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0 if report["identical"] == report["total"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
