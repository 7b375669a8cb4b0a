"""Commands that fit the edge's own parts on local text: drafters (`train-head`, `warmup`) and LoRA
adapters (`train-adapter`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from splitlm import SplitLMError
from splitlm.cli.options import int_at_least, need_edge_shard, positive_float, positive_int, set_threads
from splitlm.result_files import default_results_dir

log = logging.getLogger(__name__)


def cmd_train_adapter(args) -> int:
    from splitlm.edge.train_adapter import AdapterTraining, train_adapter

    set_threads(args.threads)
    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SplitLMError(f"cannot read the training text {args.text}: {e}") from None
    report = train_adapter(
        args.model,
        args.edge,
        text,
        args.out,
        AdapterTraining(rank=args.rank, alpha=args.alpha, steps=args.steps, lr=args.lr, seq_len=args.seq_len),
    )
    print(json.dumps(report))
    return 0


def cmd_train_head(args) -> int:
    need_edge_shard(args)
    say = lambda msg: log.info("[train-head] %s", msg)  # noqa: E731
    if args.kind == "layers":
        from splitlm.decoding.train_layer_head import LayerHeadSettings, train_layer_head

        settings = LayerHeadSettings(max_tokens=args.max_tokens or 300_000, minutes=args.minutes or 40.0)
        report = train_layer_head(args.model, args.edge, warmup=args.warmup, settings=settings, log=say, out=args.out)
    else:
        from splitlm.decoding.train_head import HeadSettings, train_head

        settings = HeadSettings(max_tokens=args.max_tokens or 1_000_000, minutes=args.minutes or 25.0)
        report = train_head(args.model, args.edge, warmup=args.warmup, settings=settings, log=say, out=args.out)
    log.info(
        "[train-head] the report is next to the head (%s) and in %s",
        Path(report["head"]).with_suffix(".json"),
        args.out,
    )
    print(json.dumps({k: v for k, v in report.items() if k != "provenance"}))
    return 0


def cmd_warmup(args) -> int:
    from splitlm.decoding.warmup import WARMUP_FILE, build_warmup

    set_threads(args.threads)
    if (args.edge is None) == (args.out is None):
        raise SplitLMError("give exactly one of --edge DIR (writes DIR/warmup.jsonl.gz) and --out FILE")
    if args.edge is not None and not Path(args.edge).is_dir():
        raise SplitLMError(f"edge shard {args.edge} not found")
    out = Path(args.edge) / WARMUP_FILE if args.edge is not None else Path(args.out)
    report = build_warmup(
        args.model,
        out,
        limit=args.limit,
        batch=args.batch,
        progress=lambda msg: log.info("[warmup] %s", msg),
        states=args.states,
    )
    print(json.dumps(report))
    return 0


def add_train_adapter(sub) -> None:
    """The `train-adapter` command's parser."""
    p = sub.add_parser("train-adapter", help="fit a LoRA adapter for the edge's layers on your own text, locally")
    p.add_argument("--model", default="default", help="the full model the edge shard was split from")
    p.add_argument("--edge", required=True, help="the edge shard directory (which layers the adapter may change)")
    p.add_argument("--text", required=True, help="a UTF-8 text file to fit")
    p.add_argument("--out", required=True, help="the adapter directory to write (peft format; use with --edge-adapter)")
    p.add_argument("--rank", type=positive_int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--alpha", type=positive_float, default=16.0, help="LoRA alpha (default 16)")
    p.add_argument("--steps", type=positive_int, default=40, help="optimiser steps (default 40)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--seq-len", type=int_at_least(2), default=128, help="tokens per training window (default 128)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.set_defaults(func=cmd_train_adapter)


def add_train_head(sub) -> None:
    """The `train-head` command's parser."""
    p = sub.add_parser(
        "train-head", help="train the edge's draft head (--spec head/auto) on the model's own warm-up answers"
    )
    p.add_argument("--model", default="default", help="the model the edge shard was split from")
    p.add_argument("--edge", required=True, help="the edge shard directory; the head is written into it")
    p.add_argument("--warmup", default=None, help="warm-up answers (default: the shard's, else the bundled ones)")
    p.add_argument(
        "--kind",
        choices=("mlp", "layers"),
        default="mlp",
        help="mlp (default): the MLP over the final state (any split of the model); layers: a decoder layer "
        "over the edge's low, middle and final features that attends over the context (for this split's K "
        "and M only; measured below the MLP so far: docs/drafters.md)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="answer tokens to train on (default: 300000 for layers, whose features take about 10 minutes "
        "on 2 cores; 1000000, every bundled answer, for mlp)",
    )
    p.add_argument(
        "--minutes",
        type=positive_float,
        default=None,
        help="training time limit (default 40 for layers, 25 for mlp)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument(
        "--out",
        default=str(default_results_dir()),
        help=f"results directory for the training report train-head-<stamp>.json (default "
        f"{default_results_dir()}); a copy is always written next to the head",
    )
    p.set_defaults(func=cmd_train_head)


def add_warmup(sub) -> None:
    """The `warmup` command's parser."""
    p = sub.add_parser(
        "warmup",
        help="generate the model's answers to generic requests, a corpus for the "
        "auto drafter (bundled for the default model)",
    )
    p.add_argument("--model", default="default", help="the full model (HF directory, .gguf or built-in name)")
    p.add_argument("--edge", default=None, help="edge shard directory: write its warmup.jsonl.gz, used from then on")
    p.add_argument("--out", default=None, help="or: write the file here")
    p.add_argument("--limit", type=positive_int, default=None, help="first N prompts only (of about 5,000)")
    p.add_argument("--batch", type=positive_int, default=16, help="prompts generated together (default 16)")
    p.add_argument(
        "--states",
        action="store_true",
        help="also keep each answer's final hidden states (warmup-states.pt beside the file, 2 bytes per token "
        "and hidden unit), so that train-head needs no second pass of the full model",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.set_defaults(func=cmd_warmup)
