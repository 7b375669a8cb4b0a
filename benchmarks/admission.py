"""How many conversations one KV budget holds at once: the paged cache (blocks of 16 entries, what the
cloud runs) against the contiguous one it replaced (grown in blocks of 256), same budget, same model.

A real cloud (in this process, `BackgroundServer`) on the bundled model's cloud shard; one client
opens sessions one after another, each sends its conversation's rows as one FORWARD (random hidden
states: the budget counts entries, not values) and keeps its session. Counted: the sessions holding
their conversations when the cloud first refuses one (CAPACITY) or frees one to make room. Every
session counts as running for the whole run (`preemption.RUNNING_S` raised), so nothing is freed
for a newcomer and the count is what the budget holds at once. Two workloads:

- `uniform`: conversations of L tokens, L uniform in [32, 512] (seeded);
- `step-512`: conversations of 512 tokens, each then making one decoding step of 8 rows;
- `short` (beside the issue's reading): conversations of L tokens, L uniform in [16, 128].

    PYTHONPATH=src python benchmarks/admission.py --split SPLIT_DIR [--budget-mb 1024] [--out benchmarks/results]

Writes `admission-<stamp>.json` (with provenance) and prints a table.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

import splitlm.cloud.preemption as preemption
from splitlm.cloud.server import BackgroundServer, CloudServer
from splitlm.cloud.sessions import ServerLimits
from splitlm.model.shards import Manifest
from splitlm.result_files import begin_run, write_result
from splitlm.transport.client import ClientOptions, CloudClient, CloudError
from splitlm.transport.errors import ErrorCode
from splitlm.transport.messages import Control, Forward, Open

MAX_SESSIONS = 600


class ContiguousCloud(CloudServer):
    paged = False  # the cache before paging: one buffer per session, grown in blocks of 256 entries


def forward(client: CloudClient, sid: int, start: int, rows: int, d: int) -> None:
    h = torch.randn(rows, d)
    request = Forward(h, torch.arange(start, start + rows), control=Control())
    client.receive_forward(client.send_forward(sid, request, "fp32", h.numel()))


def admitted(split: Path, server_cls, budget: int, conversations: list[list[int]]) -> dict:
    """Sessions that hold their conversations (each a list of FORWARD sizes) before the first refusal."""
    fp = Manifest.read(split / "edge", "edge").fingerprint
    limits = ServerLimits(kv_budget_bytes=budget, max_sessions=MAX_SESSIONS, max_sessions_per_client=MAX_SESSIONS)
    with BackgroundServer(split / "cloud", limits=limits, server_cls=server_cls) as server:
        cloud, d = server.server, server.server.model.cfg.hidden_size
        client = CloudClient(server.url, fp, ClientOptions(timeout_s=600))
        held, refusal, t0 = 0, None, time.perf_counter()
        try:
            for steps in conversations:
                try:
                    sid = client.open(Open("fp32")).session
                    start = 0
                    for rows in steps:
                        forward(client, sid, start, rows, d)
                        start += rows
                except CloudError as e:
                    if e.code not in (ErrorCode.CAPACITY, ErrorCode.PREEMPTED):
                        raise
                    refusal = str(e)
                    break
                if cloud.stats.preemptions:
                    refusal = "a session was preempted"
                    break
                held += 1
            entries = sum(s.cache.length for s in cloud.sessions.sessions.values())
            reserved = cloud.sessions.kv_reserved
        finally:
            client.close()
    return {
        "sessions": held,
        "entries_held": entries,
        "reserved_bytes": reserved,
        "reserved_per_entry_held": round(reserved / entries / cloud.budget.bytes_per_entry, 3) if entries else None,
        "stopped_by": refusal,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", type=Path, required=True, help="a split of the bundled model (edge/ and cloud/)")
    ap.add_argument("--budget-mb", type=float, default=1024.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    begin_run()
    torch.set_num_threads(1)
    preemption.RUNNING_S = 1e9  # every session counts as running: nobody is freed for a newcomer
    rng = random.Random(args.seed)
    workloads = {
        "uniform": [[rng.randint(32, 512)] for _ in range(MAX_SESSIONS)],
        "step-512": [[512, 8] for _ in range(MAX_SESSIONS)],
        "short": [[rng.randint(16, 128)] for _ in range(MAX_SESSIONS)],
    }
    budget = int(args.budget_mb * 2**20)
    results = {}
    for name, conversations in workloads.items():
        contiguous = admitted(args.split, ContiguousCloud, budget, conversations)
        paged = admitted(args.split, CloudServer, budget, conversations)
        results[name] = {
            "contiguous": contiguous,
            "paged": paged,
            "ratio": round(paged["sessions"] / contiguous["sessions"], 2) if contiguous["sessions"] else None,
        }
        print(
            f"{name}: contiguous {contiguous['sessions']} sessions, paged {paged['sessions']} "
            f"({results[name]['ratio']}x) at {args.budget_mb:g} MB"
        )
    doc = {
        "schema": "splitlm.admission/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "budget_mb": args.budget_mb,
        "seed": args.seed,
        "workloads": {
            "uniform": "one FORWARD of L rows, L uniform in [32, 512]",
            "step-512": "512 rows, then 8",
            "short": "one FORWARD of L rows, L uniform in [16, 128]",
        },
        "results": results,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(write_result(args.out, "admission", doc, stamp=stamp).json)


if __name__ == "__main__":
    main()
