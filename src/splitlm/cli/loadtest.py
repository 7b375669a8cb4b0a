"""`splitlm loadtest`: many edges against one cloud (the run itself: `splitlm.bench.loadtest`)."""

from __future__ import annotations

import argparse
import json

from splitlm import SplitLMError
from splitlm.bench.capacity import CapacityConfig
from splitlm.bench.loadtest import LoadConfig
from splitlm.bench.setup import DEFAULT_OUT
from splitlm.cli.options import non_negative_float, non_negative_int, positive_float, positive_int


def add_loadtest_arguments(p: argparse.ArgumentParser) -> None:
    d, v = LoadConfig(), CapacityConfig()
    p.add_argument(
        "--virtual-edges",
        action="store_true",
        help="the cloud's capacity curve: virtual edges replay a recorded step trace with no model "
        "compute, against a batched and a --max-batch 1 cloud (docs/benchmarks.md)",
    )
    p.add_argument(
        "--sessions",
        type=session_counts,
        default=None,
        help=f"concurrent edge sessions (default {d.sessions}); with --virtual-edges a list, one point "
        f"of the curve each (default {','.join(map(str, v.sessions))})",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help=f"tokens per session (default {d.max_new_tokens}; with --virtual-edges: per recorded "
        f"generation, default {v.max_new_tokens})",
    )
    p.add_argument(
        "--rtt-ms", type=non_negative_float, default=d.rtt_ms, help="emulated round-trip time (0 = no emulator)"
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=d.max_batch,
        help=f"the batched cloud's --max-batch (default {d.max_batch}; the baseline is 1)",
    )
    p.add_argument(
        "--spec",
        default=None,
        help="decoding mode of the sessions (default none: one token per step; "
        "with --virtual-edges the recorded edges', default auto)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=non_negative_int,
        default=d.prefill_tokens,
        help=f"length of the interfering prompt of phase 2 (default {d.prefill_tokens}; 0 = skip it)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=d.prefill_chunk,
        help=f"the started clouds' --prefill-chunk (default {d.prefill_chunk})",
    )
    p.add_argument("--wire-dtype", default=d.wire_dtype, help="activation codec (default fp32)")
    p.add_argument("--model", default=d.model, help="model to split (default: the bundled one)")
    p.add_argument("--head", type=positive_int, default=d.head, help="layers [0, K) on the edge of the split made here")
    p.add_argument("--tail", type=non_negative_int, default=None, help="layers [L-M, L) on the edge (default 2)")
    p.add_argument(
        "--edge",
        default="",
        metavar="DIR",
        help="the edge shard (default: the bundled model's split); its sibling cloud/ is served here",
    )
    p.add_argument("--cloud", default="", metavar="URL", help="use this running cloud instead (one configuration)")
    p.add_argument(
        "--ray-replicas",
        type=non_negative_int,
        default=0,
        metavar="R",
        help="compare the single-process cloud with `serve-cloud --ray --replicas R` (a local Ray "
        "instance; needs the ray extra) instead of --max-batch 1",
    )
    p.add_argument(
        "--ray-stages", type=positive_int, default=1, metavar="S", help="the Ray cloud's --stages (default 1)"
    )
    p.add_argument("--prompts", default="", help="prompt file (default benchmarks/prompts.json)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    g = p.add_argument_group("virtual edges (--virtual-edges)")
    g.add_argument("--seconds", type=positive_float, default=v.seconds, help="measured seconds per point and cloud")
    g.add_argument(
        "--warmup-s", type=non_negative_float, default=v.warmup_s, help="seconds per point before the measurement"
    )
    g.add_argument(
        "--shape",
        default="",
        metavar="NAME",
        help="serve a random-weight checkpoint of this real model's shape (e.g. tinyllama-1.1b) and "
        "replay the bundled model's trace on it (default: the --edge / --model split)",
    )
    g.add_argument(
        "--trace",
        default="",
        metavar="FILE",
        help="replay this saved step trace (default: record once and cache under ~/.cache/splitlm/traces)",
    )
    g.add_argument(
        "--trace-edge",
        default="",
        metavar="DIR",
        help="the edge shard whose steps are recorded (default: the target's; the bundled model's with --shape)",
    )
    g.add_argument("--cloud-device", default="cpu", help="the clouds' device (default cpu)")
    g.add_argument(
        "--cloud-dtype", default="fp32", help="the clouds' dtype (default fp32; bf16 for --shape on this CPU)"
    )


def session_counts(text: str) -> list[int]:
    """An argparse type: `N` or `N1,N2,...`, each a positive integer."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or a comma-separated list of numbers, got {text!r}"
        ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected session counts of at least 1, got {text!r}")
    return counts


def capacity_main(args: argparse.Namespace) -> int:
    """The capacity curve: write its JSON, table and plot; print the table (or the JSON); 1 on errors."""
    from splitlm.bench.capacity import run_capacity
    from splitlm.bench.capacity_report import markdown, write_capacity

    d = CapacityConfig()
    config = CapacityConfig(
        sessions=args.sessions or d.sessions,
        rtt_ms=args.rtt_ms,
        seconds=args.seconds,
        warmup_s=args.warmup_s,
        max_batch=args.max_batch,
        spec=args.spec or d.spec,
        max_new_tokens=args.max_new_tokens or d.max_new_tokens,
        edge=args.edge,
        model=args.model,
        shape=args.shape,
        head=args.head,
        tail=args.tail,
        trace=args.trace,
        trace_edge=args.trace_edge,
        cloud_device=args.cloud_device,
        cloud_dtype=args.cloud_dtype,
        prefill_chunk=args.prefill_chunk,
        prompts=args.prompts,
        out=args.out,
        json=args.json,
    )
    doc = run_capacity(config)
    paths = write_capacity(doc, config.out)
    if config.json:
        print(json.dumps(doc, indent=2))
    else:
        print(markdown(doc))
        print(f"\nwrote {', '.join(map(str, paths))}")
    return 0 if all(not p[s]["errors"] for p in doc["curve"] for s in ("batched", "unbatched")) else 1


def loadtest_main(args: argparse.Namespace) -> int:
    """Run the load test, write its JSON, print the table (or the JSON); 1 if a session erred or differed."""
    from splitlm.bench.loadtest import markdown, run_loadtest, write_results

    if args.virtual_edges:
        return capacity_main(args)
    if args.sessions is not None and len(args.sessions) != 1:
        raise SplitLMError("--sessions takes one number (a list only with --virtual-edges)")
    d = LoadConfig()
    config = LoadConfig(
        sessions=args.sessions[0] if args.sessions else d.sessions,
        max_new_tokens=args.max_new_tokens or d.max_new_tokens,
        rtt_ms=args.rtt_ms,
        max_batch=args.max_batch,
        spec=args.spec or d.spec,
        prefill_tokens=args.prefill_tokens,
        prefill_chunk=args.prefill_chunk,
        wire_dtype=args.wire_dtype,
        model=args.model,
        head=args.head,
        tail=args.tail,
        edge=args.edge,
        cloud=args.cloud,
        ray_replicas=args.ray_replicas,
        ray_stages=args.ray_stages,
        prompts=args.prompts,
        out=args.out,
        json=args.json,
    )
    doc = run_loadtest(config)
    (path,) = write_results(doc, config.out)
    if config.json:
        print(json.dumps(doc, indent=2))
    else:
        print(markdown(doc))
        print(f"\nwrote {path}")
    ok = all(r["identical_outputs"] == r["sessions"] and not r["errors"] for r in doc["configurations"])
    return 0 if ok else 1
