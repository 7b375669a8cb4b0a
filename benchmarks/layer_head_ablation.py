"""Compare training settings of the head that reads the edge's layers on a reduced recipe, side by side.

    .venv/bin/python benchmarks/layer_head_ablation.py features --edge EDGE --max-tokens 100000 --cache F.pt
    .venv/bin/python benchmarks/layer_head_ablation.py train --cache F.pt --minutes 8 [--start final] ...

`features` runs the full model once over the warm-up answers (as `splitlm train-head --kind layers`
does) and keeps the features, the batches' inputs and the draft vocabulary in one file; `train` fits one
head from that file with the settings given and prints its held-out acceptance by depth as one JSON line
(append `--out FILE` to keep it). Two `train` runs with one thread each, started together, share the
machine's noise. A tuning tool: what it finds is checked by a full `splitlm train-head` run.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from splitlm.decoding.layer_head import RING
from splitlm.decoding.train_head import answer_sequences, split_answers, training_inputs
from splitlm.decoding.train_layer_head import (
    LayerHeadSettings,
    acceptance,
    batches,
    fit,
    layer_features,
    new_head,
    sub_vocab,
)


def features(args) -> None:
    torch.set_num_threads(args.threads)
    settings = LayerHeadSettings(max_tokens=args.max_tokens)
    edge, _path, records, model, tok = training_inputs(args.model, Path(args.edge), None)
    layers = edge.manifest.cloud_layers
    seqs, starts = answer_sequences(records, tok, settings.steps)
    chosen, held = split_answers(seqs, starts, settings.max_tokens)
    keep = chosen + held
    t0 = time.perf_counter()
    data = layer_features(model, [seqs[i][:RING] for i in keep], layers)
    n = len(chosen)
    counts = torch.bincount(torch.cat([g for _, g in data[:n]]), minlength=model.cfg.vocab_size)
    vocab_ids = counts.topk(min(settings.vocab, model.cfg.vocab_size)).indices.sort().values
    lm_weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    torch.save(
        {
            "cfg": model.cfg,
            "layers": layers,
            "data": data,
            "seqs": [seqs[i] for i in keep],
            "starts": [starts[i] for i in keep],
            "n_train": n,
            "vocab_ids": vocab_ids,
            "emb": model.embed_tokens.weight.detach().float() * model.cfg.embed_scale,
            "lm": lm_weight.detach().float()[vocab_ids],
        },
        args.cache,
    )
    print(f"{n} training answers, {len(held)} held out; features in {time.perf_counter() - t0:.0f} s -> {args.cache}")


def windows(data, seqs, starts, width: int, seed: int):
    """Each sequence cut into pieces of `width` positions (each attends within itself only), the pieces
    shuffled across answers, so that a batch holds positions of many answers, as the MLP's do."""
    pieces = []
    for (feats, greedy), seq, start in zip(data, seqs, starts, strict=True):
        for lo in range(0, len(seq), width):
            hi = min(lo + width, len(seq))
            if hi - lo >= 6:
                pieces.append(((feats[lo:hi], greedy[lo:hi]), seq[lo:hi], start - lo))
    random.Random(seed).shuffle(pieces)
    return [p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces]


def train(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    saved = torch.load(args.cache, weights_only=False)
    settings = LayerHeadSettings(
        minutes=args.minutes,
        epochs=args.epochs,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        inner=args.inner,
        start=args.start,
        seed=args.seed,
    )
    n, data, seqs, starts = saved["n_train"], saved["data"], saved["seqs"], saved["starts"]
    head = new_head(saved["cfg"], saved["vocab_ids"], saved["layers"], settings.inner, settings.start)
    if args.window:
        train_set = batches(*windows(data[:n], seqs[:n], starts[:n], args.window, args.seed), settings.batch_tokens)
    else:
        train_set = batches(data[:n], seqs[:n], starts[:n], settings.batch_tokens)
    held = batches(data[n:], seqs[n:], starts[n:], 2048)
    t0 = time.perf_counter()
    fitted = fit(head, train_set, saved["emb"], saved["lm"], sub_vocab(head, saved["cfg"].vocab_size), settings)
    head.eval()
    line = {
        "settings": asdict(settings),
        "window": args.window,
        **fitted,
        "train_s": round(time.perf_counter() - t0, 1),
        "heldout": acceptance(head, held, saved["emb"], saved["lm"], settings.steps),
    }
    print(json.dumps(line))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(line) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("features")
    f.add_argument("--edge", required=True)
    f.add_argument("--model", default="default")
    f.add_argument("--max-tokens", type=int, default=100_000)
    f.add_argument("--cache", required=True)
    f.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("train")
    t.add_argument("--cache", required=True)
    t.add_argument("--minutes", type=float, default=8.0)
    t.add_argument("--epochs", type=float, default=4.0)
    t.add_argument("--batch-tokens", type=int, default=2048)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--inner", type=int, default=1536)
    t.add_argument("--start", choices=("random", "final"), default="final")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--window", type=int, default=0, help="train on pieces of this many positions, shuffled (0: whole)")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--out", default=None)
    args = ap.parse_args()
    {"features": features, "train": train}[args.cmd](args)


if __name__ == "__main__":
    main()
