"""The privacy audit's commands: `audit` and `harden`."""

from __future__ import annotations

import argparse
import json

from splitlm.cli.options import (
    int_at_least,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    set_threads,
)


def comma_ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return sorted(set(values))


def audit_documents(args) -> list[str]:
    from splitlm.audit.data import default_documents, read_documents

    return read_documents(args.corpus) if args.corpus else default_documents()


def cmd_audit(args) -> int:
    from splitlm.audit.config import AuditConfig
    from splitlm.audit.defences import parse_defences
    from splitlm.audit.harden import HardenConfig
    from splitlm.audit.report import write_audit
    from splitlm.audit.run import load_for_audit, run_audit

    set_threads(args.threads)
    config = AuditConfig(
        heads=args.head,
        tail=args.tail,
        attacks=[a.strip() for a in args.attacks.split(",") if a.strip()],
        defences=parse_defences(args.defence),
        seq_len=args.seq_len,
        max_train_tokens=args.max_train_tokens,
        max_eval_tokens=args.max_eval_tokens,
        whitebox_tokens=args.whitebox_tokens,
        down_whitebox_tokens=args.down_whitebox_tokens,
        candidates=args.candidates,
        probe_epochs=args.probe_epochs,
        harden=HardenConfig(steps=args.harden_steps, margin=args.harden_margin, tail=True),
        adaptive=not args.no_adaptive,
        adaptive_mlp=not args.no_adaptive_mlp,
        output_prompts=args.output_prompts,
        output_tokens=args.output_tokens,
        output_tails=args.output_tails,
        seed=args.seed,
    )
    docs = audit_documents(args)
    model, encode, model_dir = load_for_audit(args.model)
    doc = run_audit(model, encode, docs, config)
    doc["model_name"] = model_dir.name
    for path in write_audit(doc, args.out, plots=not args.no_plot):
        print(f"wrote {path}")
    return 0


def cmd_harden(args) -> int:
    from splitlm.audit.harden import HardenConfig, harden_split
    from splitlm.result_files import write_result

    set_threads(args.threads)
    config = HardenConfig(
        steps=args.steps, margin=args.margin, weight=args.weight, lr=args.lr, seed=args.seed, tail=args.private_tail
    )
    result = harden_split(
        args.model,
        args.head,
        args.tail,
        args.out,
        audit_documents(args),
        config,
        max_train_tokens=args.max_train_tokens,
    )
    write_result(args.out, "harden", result)  # DIR/harden.json
    print(json.dumps(result))
    return 0


def add_audit_parsers(sub) -> None:
    p = sub.add_parser("audit", help="privacy audit: how much text can the cloud recover from the activations?")
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--head", type=comma_ints, default=[1, 2, 4, 8], help="head depths K to audit (default 1,2,4,8)")
    p.add_argument("--tail", type=non_negative_int, default=2, help="tail layers M (default 2)")
    p.add_argument(
        "--corpus",
        nargs="+",
        metavar="FILE",
        default=None,
        help="UTF-8 text files, one document each (default: Python's pydoc topics)",
    )
    p.add_argument("--max-train-tokens", type=positive_int, default=32768, help="public text the probes learn from")
    p.add_argument("--max-eval-tokens", type=positive_int, default=1024, help="held-out tokens under attack")
    p.add_argument("--whitebox-tokens", type=positive_int, default=256, help="held-out tokens for the white-box search")
    p.add_argument(
        "--down-whitebox-tokens",
        type=positive_int,
        default=128,
        help="held-out tokens for the downlink white-box search",
    )
    p.add_argument("--candidates", type=int_at_least(5), default=64, help="white-box candidate tokens per position")
    p.add_argument("--seq-len", type=int_at_least(2), default=32, help="tokens per sequence (default 32)")
    p.add_argument("--attacks", default="nn,lens,probe,whitebox", help="comma list of nn, lens, probe, whitebox")
    p.add_argument(
        "--defence",
        default="none,noise:0.1,noise:1,quant:4,harden",
        help="comma list of none, noise:S, quant:B, harden[:STEPS] (default none,noise:0.1,noise:1,quant:4,"
        "harden; harden trains a private head and tail per K, and the adaptive attacker its own copy)",
    )
    p.add_argument(
        "--no-adaptive",
        action="store_true",
        help="skip the adaptive attackers (which rerun each defence on their own copy)",
    )
    p.add_argument(
        "--no-adaptive-mlp",
        action="store_true",
        help="the adaptive attackers train only the linear probe (the MLP probe costs the most)",
    )
    p.add_argument(
        "--output-prompts",
        type=non_negative_int,
        default=12,
        help="code and prose prompts each decoded for the output-leakage and metadata audit (0: skip)",
    )
    p.add_argument("--output-tokens", type=positive_int, default=32, help="tokens generated per traced prompt")
    p.add_argument(
        "--output-tails",
        type=comma_ints,
        default=[1, 2, 4],
        help="tail depths M for the output leakage (default 1,2,4)",
    )
    p.add_argument("--harden-steps", type=positive_int, default=20, help="training steps of the harden defence")
    p.add_argument("--harden-margin", type=positive_float, default=0.5, help="standardised distance harden aims for")
    p.add_argument("--probe-epochs", type=positive_int, default=2, help="training epochs of the MLP probe")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the corpus split and the probes")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--out", required=True, help="output directory (report.md, audit.json, audit.png)")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser(
        "harden", help="split a model with a private, hardened head (activations the public weights do not produce)"
    )
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--head", type=positive_int, default=2, help="layers [0, K) stay on the edge (default 2)")
    p.add_argument("--tail", type=non_negative_int, default=2, help="layers [L-M, L) stay on the edge (default 2)")
    p.add_argument(
        "--corpus",
        nargs="+",
        metavar="FILE",
        default=None,
        help="UTF-8 text files to train on (default: Python's pydoc topics)",
    )
    p.add_argument("--max-train-tokens", type=positive_int, default=32768, help="training tokens of the corpus")
    p.add_argument("--steps", type=positive_int, default=20, help="training steps")
    p.add_argument("--margin", type=positive_float, default=0.5, help="standardised distance to aim for (default 0.5)")
    p.add_argument(
        "--weight", type=non_negative_float, default=1.0, help="weight of the distance term against the KL term"
    )
    p.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (Adam)")
    p.add_argument(
        "--private-tail",
        action="store_true",
        help="also fine-tune the tail layers, against a cloud that runs the public tail on the downlink",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the corpus split and the training")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument("--out", required=True, help="output directory (gets edge/, cloud/ and harden.json)")
    p.set_defaults(func=cmd_harden)
