"""Choosing D for the split-head topology: what each split of the LM head costs and reveals.

For each D, over the bench prompts (each position's next-token prediction of the full model):
- cloud_share_top1: how often the cloud's own partial logits h[D:]·W[:, D:]ᵀ alone already
  point at the token the model emits (what the cloud learns from its share of the LM head,
  before the edge adds its part; it also sees h[:D], which it returns);
- edge_ms / cloud_ms: one token's part of the LM head on one CPU thread (V × D multiply-adds
  on the edge, V × (hidden − D) on the cloud);
- down_bytes_fp16: bytes of h[:D] and of the partial logits per token with every id allowed.

    PYTHONPATH=src python benchmarks/split_head_d.py [--out benchmarks/results/split-head-d.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from splitlm.bench.prompts import default_prompts_path, load_prompts, load_tokenizer, tokenize
from splitlm.model.loading import resolve_model
from splitlm.result_files import begin_run, write_result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/split-head-d.json")
    p.add_argument("--d", default="64,144,288,432,512")
    args = p.parse_args()
    begin_run()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model("default")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = load_prompts(default_prompts_path())
    tokenize(prompts, load_tokenizer(model_dir))
    w = hf.get_output_embeddings().weight.detach()  # [V, hidden]
    with torch.no_grad():  # the final normed hidden state of every prompt position
        h = torch.cat([hf.model(torch.tensor([q.ids])).last_hidden_state[0] for q in prompts])  # [N, hidden]
        full = F.linear(h, w).argmax(-1)  # [N]
    rows = []
    for d in [int(x) for x in args.d.split(",")]:
        with torch.no_grad():
            cloud_top1 = (F.linear(h[:, d:], w[:, d:]).argmax(-1) == full).float().mean().item()
            one = h[:1]
            timings = {}
            for name, part in (("edge", (one[:, :d], w[:, :d])), ("cloud", (one[:, d:], w[:, d:].contiguous()))):
                F.linear(*part)
                start = time.perf_counter()
                for _ in range(20):
                    F.linear(*part)
                timings[name] = (time.perf_counter() - start) / 20 * 1e3
        rows.append(
            {
                "d_end": d,
                "positions": int(full.numel()),
                "cloud_share_top1": round(cloud_top1, 4),
                "edge_ms": round(timings["edge"], 2),
                "cloud_ms": round(timings["cloud"], 2),
                "down_bytes_fp16": 2 * d + 2 * w.shape[0],
            }
        )
        print(rows[-1])
    out = Path(args.out)
    write_result(
        out.parent,
        out.stem,
        {"model": model_dir.name, "hidden_size": w.shape[1], "vocab_size": w.shape[0], "rows": rows},
    )


if __name__ == "__main__":
    main()
