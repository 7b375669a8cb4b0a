"""`splitlm loadtest`: many edges against one cloud (the run itself: `splitlm.bench.loadtest`)."""

from __future__ import annotations

import argparse
import json

from splitlm.bench.loadtest import LoadConfig
from splitlm.bench.suite import DEFAULT_OUT


def add_loadtest_arguments(p: argparse.ArgumentParser) -> None:
    d = LoadConfig()
    p.add_argument("--sessions", type=int, default=d.sessions, help=f"concurrent edge sessions (default {d.sessions})")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens per session")
    p.add_argument("--rtt-ms", type=float, default=d.rtt_ms, help="emulated round-trip time (0 = no emulator)")
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help=f"the batched cloud's --max-batch (default {d.max_batch}; the baseline is 1)")
    p.add_argument("--spec", default=d.spec, help="decoding mode of the sessions (default none: one token per step)")
    p.add_argument("--prefill-tokens", type=int, default=d.prefill_tokens,
                   help=f"length of the interfering prompt of phase 2 (default {d.prefill_tokens}; 0 = skip it)")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help=f"the started clouds' --prefill-chunk (default {d.prefill_chunk})")
    p.add_argument("--wire-dtype", default=d.wire_dtype, help="activation codec (default fp32)")
    p.add_argument("--model", default=d.model, help="model to split (default: the bundled one)")
    p.add_argument("--head", type=int, default=d.head, help="layers [0, K) on the edge of the split made here")
    p.add_argument("--tail", type=int, default=None, help="layers [L-M, L) on the edge (default 2)")
    p.add_argument("--edge", default="", metavar="DIR",
                   help="the edge shard (default: the bundled model's split); its sibling cloud/ is served here")
    p.add_argument("--cloud", default="", metavar="URL", help="use this running cloud instead (one configuration)")
    p.add_argument("--ray-replicas", type=int, default=0, metavar="R",
                   help="compare the single-process cloud with `serve-cloud --ray --replicas R` (a local Ray "
                        "instance; needs the ray extra) instead of --max-batch 1")
    p.add_argument("--ray-stages", type=int, default=1, metavar="S", help="the Ray cloud's --stages (default 1)")
    p.add_argument("--prompts", default="", help="prompt file (default benchmarks/prompts.json)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")


def loadtest_main(args: argparse.Namespace) -> int:
    """Run the load test, write its JSON, print the table (or the JSON); 1 if a session erred or differed."""
    from splitlm.bench.loadtest import markdown, run_loadtest, write_results

    config = LoadConfig(
        sessions=args.sessions, max_new_tokens=args.max_new_tokens, rtt_ms=args.rtt_ms, max_batch=args.max_batch,
        spec=args.spec, prefill_tokens=args.prefill_tokens, prefill_chunk=args.prefill_chunk,
        wire_dtype=args.wire_dtype, model=args.model, head=args.head, tail=args.tail, edge=args.edge,
        cloud=args.cloud, ray_replicas=args.ray_replicas, ray_stages=args.ray_stages, prompts=args.prompts,
        out=args.out, json=args.json)
    doc = run_loadtest(config)
    (path,) = write_results(doc, config.out)
    if config.json:
        print(json.dumps(doc, indent=2))
    else:
        print(markdown(doc))
        print(f"\nwrote {path}")
    ok = all(r["identical_outputs"] == r["sessions"] and not r["errors"] for r in doc["configurations"])
    return 0 if ok else 1
