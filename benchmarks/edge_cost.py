"""The edge's compute per decoding step against the tree size T, at real model shapes (issue 58, item 4).

    PYTHONPATH=src python benchmarks/edge_cost.py [--shapes smollm2-135m,qwen2.5-1.5b,llama3-8b]
        [--dtypes fp32,bf16] [--trees 1,4,16,32,64] [--reps 5] [--out benchmarks/results]

One case (shape, dtype) per child process (its peak RSS its own), one torch thread. The edge is built
in code with random weights of the shape (`splitlm.model.shards.EdgeModel`: embedding, K = 2 head
layers, M = 2 tail layers, final norm, LM head; nothing is written to disk). After a context of
`--context` tokens, each of `--reps` repetitions times, for a T-token tree step (a causal mask: the
cost of a tree mask is the same):
  head      embedding + the head layers on T tokens
  tail      the tail layers and the final norm on T rows
  lm_full   the LM head's logits for all T rows ([T, V], what a sampled step needs)
  lm_greedy the greedy token of each row (`GreedyHead`: in fp32 the bf16 screen with its exact fp32
            recheck, where it pays on this machine; in bf16 the plain head)
  draft     the draft head's tree of T nodes (`HeadDrafter`, an EAGLE-style MLP of the shipped head's
            sizes, 1024 inner, 8192-token draft vocabulary, at the model's width; random weights, grown
            to T nodes whatever its scores); 0 for T = 1
and reports each part's median. The embedding table doubles as the LM head (tied) to keep the 8B
case under 9 GB: the embedding's cost is a gather of T rows either way; the 8B's own untied head is
a second table of the same shape (2.1 GB in fp32 more, the same time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent
BASE = dict(hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
SHAPES = {  # Hugging Face configs of the three sizes (only the shapes matter here)
    "smollm2-135m": dict(
        BASE,
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    ),
    "qwen2.5-1.5b": dict(
        BASE,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
    ),
    "llama3-8b": dict(
        BASE,
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}
PARTS = ("head", "tail", "lm_full", "lm_greedy", "draft")


def build_edge(hf: dict, dtype):
    """A random-weight edge of shape `hf` (K = M = 2) in `dtype`, built on the meta device and filled in place."""
    import torch

    from splitlm.model.config import ModelConfig
    from splitlm.model.shards import EdgeModel, Manifest

    cfg = ModelConfig.from_hf(hf)
    manifest = Manifest("edge", "random", cfg.num_layers, 2, 2, "fp32")
    with torch.device("meta"):
        model = EdgeModel(cfg, manifest)
    model = model.to_empty(device="cpu").to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(dtype) * 0.02)
        for name, b in model.named_buffers():  # the rotary tables were left empty by to_empty
            if name.endswith("inv_freq") or name.endswith("inv_freq_local"):
                from splitlm.model.llama import rope_inv_freq

                b.copy_(rope_inv_freq(cfg, local=name.endswith("local")))
    return model.eval(), cfg


def drafter_for(model, cfg, nodes: int):
    import torch

    from splitlm.decoding.head import DraftHead, HeadDrafter, HeadRunner

    gen = torch.Generator().manual_seed(1)
    head = DraftHead(cfg.hidden_size, 1024, torch.randperm(cfg.vocab_size, generator=gen)[:8192])
    runner = HeadRunner(head, model.embed_tokens.weight, model.head_weight)
    return HeadDrafter(runner, max_nodes=nodes, min_reach=0.0)


def case(shape: str, dtype_name: str, trees: list[int], reps: int, context: int) -> dict:
    import torch
    import torch.nn.functional as F

    from splitlm.bench.memory import peak_rss_bytes
    from splitlm.model.llama import causal_mask

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    load_start = os.getloadavg()
    model, cfg = build_edge(SHAPES[shape], dtype)
    greedy = model.greedy_head()
    head_c, tail_c = model.head.new_cache(), model.tail.new_cache()
    out: dict = {"shape": shape, "dtype": dtype_name, "screened_head": greedy.screen, "parts_ms": {}}
    with torch.inference_mode():
        for s in range(0, context, 64):  # the context, in chunks
            ids, pos = torch.randint(0, cfg.vocab_size, (1, 64)), torch.arange(s, s + 64)
            model.tail(model.embed_and_head(ids, pos, causal_mask(64), head_c).float(), pos, causal_mask(64), tail_c)
        for t in trees:
            drafter = drafter_for(model, cfg, t)
            drafter.reset([1, 2, 3])
            times = {p: [] for p in PARTS}
            for _ in range(reps + 1):  # the first is a warm-up
                ids, pos, mask = (
                    torch.randint(0, cfg.vocab_size, (1, t)),
                    torch.arange(context, context + t),
                    causal_mask(t),
                )
                t0 = time.perf_counter()
                h = model.embed_and_head(ids, pos, mask, head_c)
                t1 = time.perf_counter()
                normed = model.tail_normed(h.float(), pos, mask, tail_c)[0]  # [T, D]
                t2 = time.perf_counter()
                F.linear(normed, model.head_weight)  # [T, V]
                t3 = time.perf_counter()
                greedy.argmax(normed)
                t4 = time.perf_counter()
                drafter.hidden = normed[-1].float()
                tree = drafter.propose() if t > 1 else None
                t5 = time.perf_counter()
                assert tree is None or len(tree) == t, (t, len(tree))
                for p, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                    times[p].append(1000 * dt)
                head_c.crop(context)
                tail_c.crop(context)
            out["parts_ms"][str(t)] = {p: round(statistics.median(v[1:]), 2) for p, v in times.items()}
            print(f"{shape} {dtype_name} T={t} {out['parts_ms'][str(t)]}", file=sys.stderr, flush=True)
    out.update(
        load_avg_start=[round(x, 2) for x in load_start],
        load_avg_end=[round(x, 2) for x in os.getloadavg()],
        peak_rss_mb=round(peak_rss_bytes() / 2**20),
        params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
    )
    return out


def markdown(doc: dict) -> str:
    trees = doc["trees"]
    lines = [
        "| shape, dtype | part | " + " | ".join(f"T = {t}" for t in trees) + " |",
        "|---|---|" + "---|" * len(trees),
    ]
    for c in doc["cases"]:
        if "error" in c:
            lines.append(f"| {c['shape']}, {c['dtype']} | error: {c['error']} |" + " |" * len(trees))
            continue
        pm = c["parts_ms"]
        for p in (*PARTS, "step"):
            vals = [
                pm[str(t)]["head"] + pm[str(t)]["tail"] + pm[str(t)]["lm_greedy"] + pm[str(t)]["draft"]
                if p == "step"
                else pm[str(t)][p]
                for t in trees
            ]
            lines.append(f"| {c['shape']}, {c['dtype']} | {p} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    return "\n".join(lines) + "\n\nstep = head + tail + lm_greedy + draft (a greedy step's edge compute), ms\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--trees", default="1,4,16,32,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    trees = [int(t) for t in args.trees.split(",")]
    if args.child:
        shape, dtype = args.child.split(":")
        print(json.dumps(case(shape, dtype, trees, args.reps, args.context)))
        return
    from splitlm.result_files import begin_run, time_stamp, write_result

    begin_run()
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    cases = []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            cmd = [sys.executable, __file__, "--child", f"{shape}:{dtype}", "--trees", args.trees]
            cmd += ["--reps", str(args.reps), "--context", str(args.context)]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=os.environ)
            if proc.returncode != 0:
                cases.append({"shape": shape, "dtype": dtype, "error": f"exit {proc.returncode}"})
            else:
                cases.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    doc = {
        "created": created,
        "what": "edge compute per decoding step (ms, median of reps) by part and tree size T; K = M = 2",
        "trees": trees,
        "reps": args.reps,
        "context_tokens": args.context,
        "threads": 1,
        "shapes": {s: SHAPES[s] for s in args.shapes.split(",")},
        "cases": cases,
    }
    written = write_result(args.out, "edge-cost", doc, stamp=time_stamp(created), markdown=markdown(doc))
    print(written.paths[0] if hasattr(written, "paths") else written)
    print(markdown(doc))


if __name__ == "__main__":
    main()
