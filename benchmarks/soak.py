"""A soak of one cloud: minutes of session churn, then everything must be back where it started.

    .venv/bin/python benchmarks/soak.py --minutes 20                   # the bundled model, 20 minutes
    .venv/bin/python benchmarks/soak.py --minutes 2 --kv-budget-mb 4   # a budget below the peak demand

One `serve-cloud --threads 1` subprocess (CPU, fp32) serves the split (`--edge DIR`, default the
bundled model's). Worker threads (`--workers`, default 6) of this process loop until the time is
up, each generation one of (seeded, by `--mix`):
- complete: a greedy generation (fp32 wire, `--spec`, `--max-new-tokens`) whose tokens must equal
  the same prompt's solo output (each prompt alone, before the churn);
- abandon: stops after 1-3 steps (the session is closed mid-generation);
- drop: a generation on a second edge whose WAN emulator cuts the connection after a random
  number of bytes (the cloud sees a dead link and frees the session; the edge reconnects and
  replays, so its tokens must still equal the solo output, reported apart).
Preemption comes from the cloud's KV budget (`--kv-budget-mb`, 0 = none): with a budget below
the peak demand a cloud that preempts frees idle sessions and their edges replay; one that only
refuses answers CAPACITY (counted as errors of that kind).

Every `--sample-s` seconds the cloud's `/metrics` (sessions, KV bytes, every counter whose name
says preempt/replay/error) and its RSS go into a time series. After the run, once the cloud's
sessions are closed: sessions and KV bytes must be 0, the RSS within 5 % of the first sample
after `--warmup-minutes`, its anonymous part too (RSS less the file-backed pages, which are the
mapped weights: the kernel drops and re-reads those under memory pressure, a leak grows the
other part), and every complete generation equal to its solo output.
Writes `OUT/soak-<stamp>.json`, `.md` and `.png` (`--out`, default as `splitlm bench`'s:
`$SPLITLM_RESULTS` or ~/.local/share/splitlm/results); exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from splitlm.bench.capacity import behind_wan, model_facts, prompt_ids  # noqa: E402
from splitlm.bench.cloud_probe import CloudProbe  # noqa: E402
from splitlm.bench.loadtest import LoadConfig, shard_dirs  # noqa: E402
from splitlm.edge.request import GenerationRequest
from splitlm.result_files import begin_run, default_results_dir, write_result  # noqa: E402

log = logging.getLogger("soak")
MB = 2**20
RSS_TOLERANCE = 0.05
BEHAVIOURS = ("complete", "abandon", "drop")


@dataclass
class Counts:
    runs: int = 0
    identical: int = 0
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)


@dataclass
class Sample:
    t: float  # seconds since the churn began
    sessions: float | None
    kv_bytes: float | None
    rss_mb: float
    anon_rss_mb: float  # RSS less its file-backed pages: the heap, where a leak would grow
    counters: dict[str, float]


class Soak:
    def __init__(self, args, edges: dict, wan_drop, references: list[list[int]], prompts: list[list[int]], spec):
        self.args, self.edges, self.wan_drop = args, edges, wan_drop
        self.references, self.prompts, self.spec = references, prompts, spec
        self.counts = {b: Counts() for b in BEHAVIOURS}
        self.lock = threading.Lock()

    def generate(self, edge, i: int, steps: int | None) -> list[int]:
        out: list[int] = []
        for n, (new, _) in enumerate(
            edge.generate_ids(
                GenerationRequest(self.prompts[i], self.args.max_new_tokens, stop_at_eos=False, spec=self.spec)
            )
        ):
            out += new
            if steps is not None and n + 1 >= steps:
                break  # abandoned: closing the generator closes the session
        return out

    def one(self, rng: random.Random) -> None:
        behaviour = rng.choices(BEHAVIOURS, weights=self.args.mix)[0]
        i = rng.randrange(len(self.prompts))
        c = self.counts[behaviour]
        try:
            if behaviour == "drop":
                self.wan_drop.cut_after(rng.randrange(2_000, 60_000))
            tokens = self.generate(
                self.edges["drop" if behaviour == "drop" else "main"],
                i,
                rng.randint(1, 3) if behaviour == "abandon" else None,
            )
            same = behaviour != "abandon" and tokens == self.references[i]
            with self.lock:
                c.runs += 1
                c.identical += same
        except Exception as e:  # noqa: BLE001 - a soak counts failures
            with self.lock:
                c.runs += 1
                c.errors += 1
                if len(c.error_messages) < 10:
                    c.error_messages.append(f"{type(e).__name__}: {e}")

    def worker(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            self.one(rng)


def sample(probe: CloudProbe, t0: float) -> Sample:
    snap = probe.snapshot()
    counters = {
        k: v
        for k, v in snap.metrics.items()
        if any(w in k for w in ("preempt", "replay", "errors", "evictions", "capacity")) and not k.endswith("_sum")
    }
    return Sample(
        round(time.monotonic() - t0, 1),
        snap.value("splitlm_cloud_sessions"),
        snap.value("splitlm_cloud_kv_reserved_bytes"),
        round(snap.rss / MB, 1),
        round((snap.rss - snap.rss_file) / MB, 1),
        counters,
    )


def sampler(probe: CloudProbe, t0: float, every: float, stop: threading.Event, out: list[Sample]) -> None:
    while not stop.wait(every):
        with contextlib.suppress(OSError):
            out.append(sample(probe, t0))


def settle(probe: CloudProbe, t0: float, timeout_s: float = 60.0) -> Sample:
    """The cloud once its sessions are gone (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    s = sample(probe, t0)
    while (s.sessions or s.kv_bytes) and time.monotonic() < deadline:
        time.sleep(1.0)
        s = sample(probe, t0)
    return s


def drift_check(baseline_mb: float, end_mb: float) -> dict:
    drift = (end_mb - baseline_mb) / baseline_mb
    return {"value": round(drift, 4), "baseline_mb": baseline_mb, "end_mb": end_mb, "ok": abs(drift) <= RSS_TOLERANCE}


def checks(counts: dict[str, Counts], baseline: Sample, end: Sample) -> dict:
    done = counts["complete"]
    return {
        "sessions_back_to_zero": {"value": end.sessions, "ok": end.sessions == 0},
        "kv_bytes_back_to_zero": {"value": end.kv_bytes, "ok": end.kv_bytes == 0},
        "rss_within_5_percent": drift_check(baseline.rss_mb, end.rss_mb),
        "anon_rss_within_5_percent": drift_check(baseline.anon_rss_mb, end.anon_rss_mb),
        "complete_outputs_identical": {
            "value": f"{done.identical}/{done.runs}",
            "ok": done.runs > 0 and done.identical == done.runs,
        },
    }


def markdown(doc: dict) -> str:
    lines = ["| behaviour | runs | identical to solo | errors |", "|---|---|---|---|"]
    for b, c in doc["counts"].items():
        lines.append(f"| {b} | {c['runs']} | {c['identical'] if b != 'abandon' else '–'} | {c['errors']} |")
    lines += ["", "| check | value | ok |", "|---|---|---|"]
    lines += [f"| {k} | {v['value']} | {v['ok']} |" for k, v in doc["checks"].items()]
    counters = ", ".join(f"{k} {v:g}" for k, v in doc["cloud_counters_end"].items())
    lines += ["", f"the cloud's counters at the end: {counters}; connections cut: {doc['connection_cuts']}"]
    return "\n".join(lines)


def plot(doc: dict, base: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["samples"]
    t = [x["t"] / 60 for x in s]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for ax, (key, label, scale) in zip(
        axes,
        [("sessions", "open sessions", 1), ("kv_bytes", "KV MB", 1 / MB), ("rss_mb", "cloud RSS MB", 1)],
        strict=True,
    ):
        ax.plot(t, [(x[key] or 0) * scale for x in s], "-", color="#4c78a8", label=label)
        if key == "rss_mb":
            ax.plot(t, [x.get("anon_rss_mb") or 0 for x in s], "-", color="#f58518", label="anonymous (heap)")
            ax.legend(fontsize=8)
        ax.axvline(doc["config"]["warmup_minutes"], color="#999", ls="--", lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes (dashed: end of warm-up)")
    fig.suptitle(
        f"soak: {doc['config']['minutes']} min, {doc['config']['workers']} workers, "
        f"KV budget {doc['config']['kv_budget_mb'] or 'none'} MB",
        fontsize=9,
    )
    fig.tight_layout()
    path = base.with_name(base.name + ".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0, help="length of the churn (default 20)")
    p.add_argument("--warmup-minutes", type=float, default=1.0, help="the RSS baseline is taken after this (default 1)")
    p.add_argument("--edge", default="", help="edge shard (default: the bundled model's split)")
    p.add_argument("--workers", type=int, default=6, help="concurrent generations (default 6)")
    p.add_argument("--rtt-ms", type=float, default=40.0, help="the WAN emulators' RTT (default 40)")
    p.add_argument("--spec", default="auto", help="decoding mode (default auto)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens per generation (default 24)")
    p.add_argument("--prompts", type=int, default=8, help="the first N prompts of benchmarks/prompts.json (default 8)")
    p.add_argument("--kv-budget-mb", type=int, default=0, help="the cloud's --kv-budget-mb (default 0: none)")
    p.add_argument("--cloud-args", default="", help="more serve-cloud arguments, space-separated")
    p.add_argument(
        "--mix",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[6, 2, 2],
        help="weights of complete,abandon,drop (default 6,2,2)",
    )
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the behaviours and prompts (default 0)")
    p.add_argument(
        "--out",
        default=str(default_results_dir()),
        help="results directory (default $SPLITLM_RESULTS or ~/.local/share/splitlm/results)",
    )
    return p.parse_args(argv)


def cloud_arguments(args) -> list[str]:
    extra = [
        "--max-sessions-per-client",
        str(2 * args.workers + 4),
        "--max-sessions",
        str(max(64, 2 * args.workers + 4)),
    ]
    if args.kv_budget_mb:
        extra += ["--kv-budget-mb", str(args.kv_budget_mb)]
    return extra + args.cloud_args.split()


def references(edge, prompts: list[list[int]], args, spec) -> list[list[int]]:
    out = []
    for ids in prompts:
        tokens: list[int] = []
        for new, _ in edge.generate_ids(GenerationRequest(ids, args.max_new_tokens, stop_at_eos=False, spec=spec)):
            tokens += new
        out.append(tokens)
    return out


def churn(soak: Soak, probe: CloudProbe, args) -> tuple[list[Sample], float]:
    """Run the workers until the time is up, sampling the cloud; (samples, start)."""
    t0 = time.monotonic()
    samples: list[Sample] = [sample(probe, t0)]
    stop = threading.Event()
    threads = [threading.Thread(target=sampler, args=(probe, t0, args.sample_s, stop, samples), daemon=True)]
    deadline = t0 + args.minutes * 60
    threads += [
        threading.Thread(target=soak.worker, args=(args.seed + i, deadline), daemon=True) for i in range(args.workers)
    ]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    return samples, t0


def main(argv: list[str] | None = None) -> int:
    from splitlm.bench.wan import WanEmulator
    from splitlm.bench.wan_link import WanConfig
    from splitlm.cloud.local import cloud_process
    from splitlm.edge import Edge, EdgeConfig
    from splitlm.edge.runtime import as_spec

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    begin_run(argv)
    edge_dir, cloud_dir = shard_dirs(LoadConfig(edge=args.edge))
    _, _, vocab, _ = model_facts(edge_dir)
    prompts = [ids for _, ids in prompt_ids(edge_dir, "", vocab)][: args.prompts]
    spec = as_spec(args.spec)
    with (
        cloud_process(cloud_dir, "cpu", "fp32", cloud_arguments(args)) as port,
        behind_wan(port, args.rtt_ms) as url,
        WanEmulator(("127.0.0.1", port), WanConfig(args.rtt_ms, seed=args.seed)) as wan_drop,
        Edge(edge_dir, url, EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32")) as main_edge,
        Edge(edge_dir, wan_drop.url_for("ws"), EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32")) as drop_edge,
    ):
        probe = CloudProbe.for_port(port)
        log.info("solo references: %d prompts", len(prompts))
        refs = references(main_edge, prompts, args, spec)
        soak = Soak(args, {"main": main_edge, "drop": drop_edge}, wan_drop, refs, prompts, spec)
        log.info("churn: %g minutes, %d workers", args.minutes, args.workers)
        samples, t0 = churn(soak, probe, args)
        end = settle(probe, t0)
        samples.append(end)
        cuts = wan_drop.cuts
    warm = next((s for s in samples if s.t >= args.warmup_minutes * 60), samples[-1])
    doc = {
        "schema": "splitlm.soak/1",
        "config": vars(args),
        "edge": str(edge_dir),
        "wire_dtype": "fp32",
        "cloud": "serve-cloud --threads 1, cpu, fp32 " + " ".join(cloud_arguments(args)),
        "connection_cuts": cuts,
        "counts": {b: asdict(c) for b, c in soak.counts.items()},
        "checks": checks(soak.counts, warm, end),
        "cloud_counters_end": end.counters,
        "samples": [asdict(s) for s in samples],
    }
    doc["ok"] = all(c["ok"] for c in doc["checks"].values())
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    written = write_result(args.out, "soak", doc, stamp=stamp, markdown=markdown(doc), plots=lambda b: plot(doc, b))
    print(markdown(doc))
    print(f"\nwrote {', '.join(map(str, written.paths))}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
