"""Prefix reuse through serve-edge's API at an emulated RTT (docs/prefix-reuse.md).

Two experiments on the bundled model, each request streamed over HTTP like an app's:

1. A 6-turn conversation (user turns of about 200 tokens, answers of up to 128) with reuse (the
   default prefix pool) and without (`--prefix-pool 0`): time to first token, uplink bytes and
   cached tokens per turn. The cold arm sends the reuse arm's exact messages (same prompts), and
   its answers are compared with the reuse arm's.
2. 8 requests sharing a 1,000-token system prompt, each with its own short question: TTFT of
   requests 2-8 against the first (and, for reference, the same requests without reuse).

Targets (issue 37): with reuse, turn 6's TTFT <= 1.5x turn 1's; shared-prompt requests 2-8 <= 0.3x
the first's. The edge (one torch thread) and each arm's API run in this process, the cloud in a
`serve-cloud --threads 1` subprocess, the WAN emulator in a thread of this process; the arms run one
after the other, each with its own `Edge` (the drafters' memory of one arm never helps the other).

    .venv/bin/python benchmarks/prefix_reuse.py                  # 80 ms, the full setting
    .venv/bin/python benchmarks/prefix_reuse.py --short          # a quick check (2 short turns, 3 requests)

Writes prefix-reuse-<stamp>.json and .md under --out (default: the results directory of `splitlm bench`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
import urllib.request
from pathlib import Path
from statistics import median

import torch

from splitlm.bench.wan import WanConfig, WanEmulator
from splitlm.cloud.local import cloud_process
from splitlm.decoding.modes import SpecConfig
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.api import APIConfig, EdgeAPI
from splitlm.edge.api_serve import serving
from splitlm.edge.prefix_pool import PoolLimits
from splitlm.model.shards import cached_split
from splitlm.result_files import begin_run, default_results_dir, time_stamp, write_result

log = logging.getLogger("prefix_reuse")
TEXT = Path(__file__).with_name("prefix-reuse.json")  # the conversation's turns, the system prompt, the questions
MODEL = "bench"


def stream_chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat completion: its text, TTFT as the client sees it, usage and stats."""
    body = {
        "model": MODEL,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start, ttft, pieces, last = time.perf_counter(), None, [], {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            data = line.decode().strip()
            if not data.startswith("data: ") or data == "data: [DONE]":
                continue
            event = json.loads(data[6:])
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - start
                    pieces.append(choice["delta"]["content"])
            last = event if "usage" in event else last
    s = last["splitlm"]
    return {
        "text": "".join(pieces),
        "ttft_s": round(ttft or time.perf_counter() - start, 4),
        "prompt_tokens": last["usage"]["prompt_tokens"],
        "answer_tokens": last["usage"]["completion_tokens"],
        "cached_tokens": last["usage"]["prompt_tokens_details"]["cached_tokens"],
        "bytes_up": s["bytes_up"],
        "bytes_down": s["bytes_down"],
        "round_trips": s["round_trips"],
        "server_ttft_s": round(s["setup_s"] + s["prefill_s"], 4),
        "failovers": s["failovers"],
    }


@contextlib.contextmanager
def arm(split: Path, url: str, args, reuse: bool):
    """One arm: its own Edge and API (with or without the pool), served; yields the API's base URL."""
    spec = SpecConfig(args.spec)
    limits = PoolLimits() if reuse else PoolLimits(sessions=0)
    with Edge(split / "edge", url, EdgeConfig(wire_dtype=args.wire_dtype)) as edge:
        edge.drafting.draft_memory(spec)  # built now, as serve-edge does, not in the first request
        api = EdgeAPI(edge, APIConfig(model_name=MODEL, spec=spec, prefix_pool=limits))
        try:
            with serving(api.app) as base:
                warm = {"model": MODEL, "prompt": "Warm-up:", "max_tokens": 4, "temperature": 0}  # no chat prefix
                urllib.request.urlopen(
                    urllib.request.Request(
                        base + "/v1/completions", json.dumps(warm).encode(), {"Content-Type": "application/json"}
                    ),
                    timeout=120,
                ).read()
                yield base
        finally:
            api.close()


def conversation(base: str, turns: list[str], max_tokens: int, script: list[list[dict]] | None) -> list[dict]:
    """The turns one after another; with `script` (the other arm's messages per turn) the same prompts."""
    messages, rows = [], []
    for i, turn in enumerate(turns):
        messages = list(script[i]) if script else messages + [{"role": "user", "content": turn}]
        row = stream_chat(base, messages, max_tokens)
        row["messages"] = list(messages)
        rows.append(row)
        log.info(
            "turn %d: %d prompt tokens, %d reused, TTFT %.0f ms, up %.0f KiB",
            i + 1,
            row["prompt_tokens"],
            row["cached_tokens"],
            row["ttft_s"] * 1000,
            row["bytes_up"] / 1024,
        )
        messages = messages + [{"role": "assistant", "content": row["text"]}]
    return rows


def shared_prompt(base: str, system: str, questions: list[str], max_tokens: int) -> list[dict]:
    rows = []
    for i, q in enumerate(questions):
        row = stream_chat(base, [{"role": "system", "content": system}, {"role": "user", "content": q}], max_tokens)
        rows.append(row)
        log.info(
            "request %d: %d prompt tokens, %d reused, TTFT %.0f ms",
            i + 1,
            row["prompt_tokens"],
            row["cached_tokens"],
            row["ttft_s"] * 1000,
        )
    return rows


def summary(conv: dict, shared: dict) -> dict:
    reuse, cold = conv["reuse"], conv["cold"]
    first, rest = shared["reuse"][0]["ttft_s"], [r["ttft_s"] for r in shared["reuse"][1:]]
    return {
        "turns": [
            {
                "turn": i + 1,
                "prompt_tokens": r["prompt_tokens"],
                "cached_tokens": r["cached_tokens"],
                "ttft_reuse_s": r["ttft_s"],
                "ttft_cold_s": c["ttft_s"],
                "bytes_up_reuse": r["bytes_up"],
                "bytes_up_cold": c["bytes_up"],
                "same_answer": r["text"] == c["text"],
            }
            for i, (r, c) in enumerate(zip(reuse, cold, strict=True))
        ],
        "last_over_first_turn_reuse": round(reuse[-1]["ttft_s"] / reuse[0]["ttft_s"], 3),
        "last_over_first_turn_cold": round(cold[-1]["ttft_s"] / cold[0]["ttft_s"], 3),
        "target_last_over_first": 1.5,
        "shared_first_ttft_s": first,
        "shared_rest_median_ttft_s": round(median(rest), 4),
        "shared_rest_max_over_first": round(max(rest) / first, 3),
        "shared_rest_median_over_first": round(median(rest) / first, 3),
        "shared_cold_median_ttft_s": round(median(r["ttft_s"] for r in shared["cold"]), 4),
        "target_rest_over_first": 0.3,
        "shared_same_answers": all(
            a["text"] == b["text"] for a, b in zip(shared["reuse"], shared["cold"], strict=True)
        ),
    }


def markdown(doc: dict) -> str:
    s, cfg = doc["summary"], doc["config"]
    lines = [
        f"# Prefix reuse through the API, {doc['created']}",
        "",
        f"{cfg['model']} (split 2/2), spec `{cfg['spec']}`, wire {cfg['wire_dtype']}, RTT {cfg['rtt_ms']:g} ms; "
        "edge 1 torch thread, cloud `serve-cloud --threads 1`.",
        "",
        "## A conversation",
        "",
        "| turn | prompt tokens | reused | TTFT reuse | TTFT cold | up reuse | up cold | same answer |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for t in s["turns"]:
        lines.append(
            f"| {t['turn']} | {t['prompt_tokens']} | {t['cached_tokens']} | {t['ttft_reuse_s'] * 1000:.0f} ms | "
            f"{t['ttft_cold_s'] * 1000:.0f} ms | {t['bytes_up_reuse'] / 1024:.0f} KiB | "
            f"{t['bytes_up_cold'] / 1024:.0f} KiB | {'yes' if t['same_answer'] else 'NO'} |"
        )
    lines += [
        "",
        f"Last turn's TTFT over the first's: **{s['last_over_first_turn_reuse']:.2f}×** with reuse "
        f"(target ≤ {s['target_last_over_first']}×), {s['last_over_first_turn_cold']:.2f}× without.",
        "",
        "## Requests sharing a system prompt",
        "",
        "| request | prompt tokens | reused | TTFT | TTFT without reuse |",
        "|---:|---:|---:|---:|---:|",
    ]
    for i, (r, c) in enumerate(zip(doc["shared"]["reuse"], doc["shared"]["cold"], strict=True)):
        lines.append(
            f"| {i + 1} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_s'] * 1000:.0f} ms | "
            f"{c['ttft_s'] * 1000:.0f} ms |"
        )
    lines += [
        "",
        f"Requests 2–{len(doc['shared']['reuse'])} over the first: median "
        f"**{s['shared_rest_median_over_first']:.2f}×**, at most {s['shared_rest_max_over_first']:.2f}× "
        f"(target ≤ {s['target_rest_over_first']}×); same answers with and without reuse: "
        f"{'yes' if s['shared_same_answers'] else 'NO'}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="the model to split (default: the bundled one)")
    p.add_argument("--rtt-ms", type=float, default=80.0, help="emulated round-trip time")
    p.add_argument("--spec", default="auto", help="serve-edge's --spec")
    p.add_argument("--wire-dtype", default="auto", help="the edge's wire codec (auto: fp16)")
    p.add_argument("--turns", type=int, default=6, help="conversation turns (at most 6)")
    p.add_argument("--answer-tokens", type=int, default=128, help="max_tokens of each turn's answer")
    p.add_argument("--requests", type=int, default=8, help="requests sharing the system prompt (at most 8)")
    p.add_argument("--question-tokens", type=int, default=32, help="max_tokens of each shared-prompt request")
    p.add_argument(
        "--short",
        action="store_true",
        help="a quick check: 2 turns cut to 40 words, 16-token answers, 3 requests, a 150-word system prompt",
    )
    p.add_argument("--out", type=Path, default=default_results_dir(), help="where the result files go")
    args = p.parse_args()
    begin_run()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    text = json.loads(TEXT.read_text())
    turns, system, questions = text["turns"][: args.turns], text["system"], text["questions"][: args.requests]
    if args.short:
        turns = [" ".join(t.split()[:40]) for t in turns[:2]]
        system, questions = " ".join(system.split()[:150]), questions[:3]
        args.answer_tokens, args.question_tokens = 16, 8
    split = cached_split(args.model)
    created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    conv, shared = {}, {}
    with (
        cloud_process(split / "cloud", "cpu", "fp32") as port,
        WanEmulator(upstream=("127.0.0.1", port), config=WanConfig(rtt_ms=args.rtt_ms)) as wan,
    ):
        for name, reuse in (("reuse", True), ("cold", False)):
            log.info("[prefix-reuse] %s arm", name)
            with arm(split, wan.url_for("ws"), args, reuse) as base:
                script = None if reuse else [r["messages"] for r in conv["reuse"]]
                conv[name] = conversation(base, turns, args.answer_tokens, script)
                shared[name] = shared_prompt(base, system, questions, args.question_tokens)
    for row in conv["reuse"] + conv["cold"]:
        row.pop("messages")  # the texts stay in the rows (`text`), the prompts in benchmarks/prefix-reuse.json
    doc = {
        "created": created,
        "config": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "threads": {"edge": 1, "cloud": 1, "wan_emulator": "a thread of this process"},
        },
        "summary": summary(conv, shared),
        "conversation": conv,
        "shared": shared,
    }
    written = write_result(args.out, "prefix-reuse", doc, stamp=time_stamp(created), markdown=markdown(doc))
    print(markdown(doc))
    print("\n".join(str(path) for path in written.paths))


if __name__ == "__main__":
    main()
