"""The benchmark commands (`bench`, `loadtest`, `wan`); their code lives in `splitlm.bench`.

`bench` runs the WAN benchmark (`bench.suite`) or, with one of its switches, another bench of its own:
`--pass-cost` (`bench.passcost`), `--prefill` (`bench.prefill`), `--edge-profiles` (`bench.edge_profiles`).
Each writes its result files (`bench.results`) and prints its tables here.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from splitlm import SplitLMError
from splitlm.bench.setup import DEFAULT_MODES, DEFAULT_OUT, BenchConfig
from splitlm.cli.options import non_negative_float, non_negative_int, positive_float, positive_int

log = logging.getLogger(__name__)


def add_bench_parsers(sub) -> None:
    """The parsers of `bench`, `loadtest` and (with its dependencies) `wan`."""
    from splitlm.cli.loadtest import add_loadtest_arguments, loadtest_main

    p = sub.add_parser("bench", help="benchmark split decoding behind an emulated WAN")
    add_bench_arguments(p)
    p.set_defaults(func=bench_main)

    p = sub.add_parser("loadtest", help="many edges against one cloud behind an emulated WAN: batched vs --max-batch 1")
    add_loadtest_arguments(p)
    p.set_defaults(func=loadtest_main)

    try:
        from splitlm.cli.wan import add_wan_arguments, wan_main
    except ImportError:
        pass
    else:
        p = sub.add_parser("wan", help="emulate a wide-area link: a delaying TCP proxy")
        add_wan_arguments(p)
        p.set_defaults(func=wan_main)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `bench`: the WAN bench's, then those of its other benches."""
    add_wan_bench_arguments(p)
    add_pass_cost_arguments(p)
    add_prefill_arguments(p)
    p.add_argument(
        "--edge-profiles",
        action="store_true",
        help="instead of the WAN bench: the edge's peak memory, compute per step and agreement in each "
        "profile (torch fp32, torch bf16, onnx fp32, onnx int8) on the tuning set prompts-tuning.json "
        "(--limit, default 8; --max-new-tokens; --threads)",
    )
    p.add_argument(
        "--threads", type=positive_int, default=None, help="--edge-profiles: threads per profile (default 2)"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the per-mode peak-memory probes")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--no-train-head",
        action="store_true",
        help="run auto without the draft head when none is trained for the model (else it is trained "
        "once, about 10 minutes, before the modes that use it)",
    )


def add_wan_bench_arguments(p: argparse.ArgumentParser) -> None:
    from splitlm.bench.modes import ALIASES, MODES
    from splitlm.model.device import add_device_arguments
    from splitlm.transport.codecs import WIRE_DTYPES

    p.add_argument(
        "--rtt-ms", type=non_negative_float, default=80.0, help="emulated round-trip time (default 80; 0 = no emulator)"
    )
    p.add_argument(
        "--sweep",
        default=None,
        metavar="R1,R2,...",
        help="run at each of these RTTs (ms) instead and fit t_step = α·RTT + β per mode",
    )
    known = "; ".join(f"{m.name}: {m.help}" for m in MODES.values())
    aliases = ", ".join(f"{a}={n}" for a, n in ALIASES.items())
    p.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help=f"comma-separated modes (default {DEFAULT_MODES}). {known}. Aliases: {aliases}",
    )
    p.add_argument(
        "--prompts",
        default="",
        help="prompt file (default benchmarks/prompts.json), or Spec-Bench's question.jsonl (docs/benchmarks.md)",
    )
    p.add_argument(
        "--categories",
        default=None,
        metavar="C1,C2",
        help="only these categories (Spec-Bench: mt_bench, translation, summarization, qa, math_reasoning, rag; "
        "a JSON prompt file: its own, e.g. code)",
    )
    p.add_argument(
        "--per-category",
        type=positive_int,
        default=None,
        metavar="N",
        help="Spec-Bench: N evenly spaced questions per category, by question_id (default all)",
    )
    p.add_argument(
        "--mode-questions",
        default="",
        metavar="MODE=M,...",
        help="Spec-Bench: run MODE on M of each category's --per-category questions only (evenly spaced)",
    )
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="only the first N prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens per prompt (default 64)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--head", type=positive_int, default=2, help="edge head layers K (default 2)")
    p.add_argument("--tail", type=non_negative_int, default=None, help="edge tail layers M (default 2; split-head: 0)")
    p.add_argument(
        "--edge",
        default="",
        metavar="DIR",
        help="benchmark this pre-split edge shard (its cloud shard is DIR/../cloud) instead of splitting "
        "--model here; its topology, K, M and D come from its manifest",
    )
    p.add_argument(
        "--topology",
        default="tail-local",
        choices=["tail-local", "split-head"],
        help="when splitting here: the topology (default tail-local)",
    )
    p.add_argument(
        "--d-end",
        type=int,
        default=None,
        metavar="D",
        help="split-head: LM-head columns kept on the edge (default half the hidden size)",
    )
    p.add_argument(
        "--vocab",
        default="all",
        metavar="{all,en,zh,FILE}",
        help="the edge's vocabulary subset (default all); split-head clouds compute logits for it only",
    )
    p.add_argument(
        "--wire-dtype",
        default="auto",
        choices=["auto", *WIRE_DTYPES],
        help="activation codec of the modes (default auto: fp16, bf16 for Gemma)",
    )
    p.add_argument(
        "--codecs",
        default="",
        metavar="C1,C2,...",
        help=f"also run the codec study for these codecs ({','.join(WIRE_DTYPES)}, or 'all'): bytes per "
        "token and agreement with the full model's greedy tokens",
    )
    p.add_argument("--jitter-ms", type=non_negative_float, default=0.0, help="± uniform jitter per direction (ms)")
    p.add_argument("--mbps", type=positive_float, default=None, help="bandwidth cap per direction (Mbit/s)")
    add_device_arguments(p, what="the edge's (and, unless --cloud-device says otherwise, the cloud's) layers")
    add_device_arguments(p, "cloud", what="the cloud's layers")


def add_pass_cost_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pass-cost",
        default=None,
        metavar="SHAPE",
        help="instead of the WAN bench: time the cloud's middle layers of a model shape (random weights "
        "made on --cloud-device) per pass of T new tokens; shapes: smollm2-135m, tinyllama-1.1b, "
        "llama3-8b, qwen2-small",
    )
    p.add_argument(
        "--pass-tokens",
        default="1,8,32,64,128",
        metavar="T1,T2,...",
        help="--pass-cost: new tokens per pass (default 1,8,32,64,128)",
    )
    p.add_argument(
        "--pass-context", type=non_negative_int, default=512, help="--pass-cost: cached entries before each pass (512)"
    )
    p.add_argument(
        "--pass-dtypes",
        default="",
        metavar="D1,D2",
        help="--pass-cost: compute dtypes to time (default: --cloud-dtype, else --dtype)",
    )


def add_prefill_arguments(p: argparse.ArgumentParser) -> None:
    from splitlm.bench.prefill import DEFAULT_LENGTHS
    from splitlm.bench.prefill import DEFAULT_OUT as PREFILL_OUT

    p.add_argument(
        "--prefill",
        action="store_true",
        help="instead: time to first token of streamed vs unchunked prefill per prompt length and "
        f"bandwidth, next to the pipeline's bound (results in {PREFILL_OUT}/)",
    )
    p.add_argument(
        "--prefill-lengths",
        default=",".join(map(str, DEFAULT_LENGTHS)),
        metavar="N1,N2,...",
        help="--prefill: prompt lengths in tokens (default 64,...,4096)",
    )
    p.add_argument(
        "--prefill-mbps",
        default="100,10",
        metavar="B1,B2,...",
        help="--prefill: bandwidths per direction in Mbit/s (default 100,10)",
    )
    p.add_argument("--repeats", type=positive_int, default=1, help="--prefill: runs per mode and cell (default 1)")


def parse_rtt_list(text: str) -> list[float]:
    """'20,40,80' -> [20.0, 40.0, 80.0]; raise SplitLMError on anything else."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SplitLMError(f"bad --sweep {text!r}: expected RTTs in ms separated by commas, e.g. 20,40,80") from None
    if len(set(values)) < 2 or any(not v >= 0 for v in values):
        raise SplitLMError(f"bad --sweep {text!r}: need at least two different RTTs >= 0 ms")
    return sorted(set(values))


def parse_codecs(text: str) -> list[str]:
    from splitlm.transport.codecs import WIRE_DTYPES

    codecs = list(WIRE_DTYPES) if text.strip() == "all" else [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in codecs if c not in WIRE_DTYPES]
    if bad:
        raise SplitLMError(f"unknown codec(s) {', '.join(bad)} in --codecs (choose from {', '.join(WIRE_DTYPES)}, all)")
    return codecs


def parse_mode_questions(text: str) -> dict[str, int]:
    """'recycle=10,suffix=10' -> {'recycle': 10, 'suffix': 10}; SplitLMError on anything else."""
    from splitlm.bench.modes import parse_modes

    caps = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        mode, _, n = item.partition("=")
        if not n.strip().isdigit() or int(n) < 1:
            raise SplitLMError(f"--mode-questions {item!r}: expected MODE=N with N >= 1, e.g. recycle=10")
        caps[parse_modes(mode)[0]] = int(n)
    return caps


def check_bench_args(args: argparse.Namespace) -> None:
    """Refuse values and combinations the WAN bench cannot run, with the reason."""
    if args.edge and (args.topology != "tail-local" or args.d_end is not None or args.tail is not None):
        raise SplitLMError("--edge benchmarks an existing split: its topology, --tail and --d-end come from it")
    if args.topology == "split-head" and args.tail:
        raise SplitLMError("the split-head topology keeps no tail layers on the edge: drop --tail")
    if args.d_end is not None and args.topology != "split-head":
        raise SplitLMError("--d-end only applies to --topology split-head")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from splitlm.bench.modes import parse_modes

    check_bench_args(args)
    return BenchConfig(
        rtts_ms=parse_rtt_list(args.sweep) if args.sweep else [args.rtt_ms],
        modes=parse_modes(args.modes),
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        out=args.out,
        model=args.model,
        head=args.head,
        tail=args.tail,
        wire_dtype=args.wire_dtype,
        edge=args.edge,
        topology=args.topology,
        d_end=args.d_end,
        vocab=args.vocab,
        jitter_ms=args.jitter_ms,
        mbps=args.mbps,
        limit=args.limit,
        memory=not args.no_memory,
        plots=not args.no_plots,
        train_head=not args.no_train_head,
        codecs=parse_codecs(args.codecs),
        per_category=args.per_category,
        categories=[c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None,
        mode_questions=parse_mode_questions(args.mode_questions),
        device=args.device,
        dtype=args.dtype,
        cloud_device=args.cloud_device,
        cloud_dtype=args.cloud_dtype,
    )


def report(markdown: str, paths: list[Path]) -> int:
    """Print a bench's tables (stdout) and say where its files are (a status line)."""
    print(markdown)
    log.info("[bench] wrote " + ", ".join(str(p) for p in paths))
    return 0


def pass_cost_main(args: argparse.Namespace) -> int:
    from splitlm.bench.passcost import markdown, pass_cost_doc, write_results
    from splitlm.model.device import resolve_device, resolve_dtype

    try:
        tokens = [int(t) for t in args.pass_tokens.split(",") if t.strip()]
    except ValueError:
        raise SplitLMError(f"--pass-tokens {args.pass_tokens!r}: expected integers such as 1,8,32") from None
    if not tokens or min(tokens) < 1 or args.pass_context < 0:
        raise SplitLMError("--pass-tokens must be integers >= 1 and --pass-context >= 0")
    device = resolve_device(args.cloud_device or args.device)
    names = [d.strip() for d in args.pass_dtypes.split(",") if d.strip()] or [args.cloud_dtype or args.dtype]
    dtypes = [resolve_dtype(d, device) for d in names]
    doc = pass_cost_doc(args.pass_cost, device, dtypes, tokens, args.pass_context, reps=10)
    return report(markdown(doc), write_results(doc, args.out))


def prefill_main(args: argparse.Namespace) -> int:
    from splitlm.bench import prefill

    if args.edge or args.topology != "tail-local":
        raise SplitLMError("--prefill benchmarks a tail-local split of --model (drop --edge and --topology)")
    config = prefill.PrefillBenchConfig(
        lengths=prefill.parse_list(args.prefill_lengths, "--prefill-lengths", int),
        mbps=prefill.parse_list(args.prefill_mbps, "--prefill-mbps", float),
        rtt_ms=args.rtt_ms,
        repeats=args.repeats,
        model=args.model,
        head=args.head,
        tail=2 if args.tail is None else args.tail,
        wire_dtype=args.wire_dtype,
        device=args.device,
        dtype=args.dtype,
        cloud_device=args.cloud_device,
        cloud_dtype=args.cloud_dtype,
        out=str(prefill.DEFAULT_OUT) if args.out == str(DEFAULT_OUT) else args.out,
    )
    doc = prefill.run_prefill_bench(config)
    return report(prefill.markdown(doc), prefill.write_results(doc, config.out))


def edge_profiles_main(args: argparse.Namespace, config: BenchConfig) -> int:
    """`bench --edge-profiles` on the tail-local split of `config` (made here, or `--edge`'s)."""
    from splitlm.bench.edge_profiles import edge_profiles_doc, markdown, tuning_prompts, write_results
    from splitlm.bench.setup import resolve_split
    from splitlm.model.loading import resolve_model

    if config.topology != "tail-local":
        raise SplitLMError("--edge-profiles needs the tail-local topology (the ONNX edge has a tail)")
    split_dir = resolve_split(config, resolve_model(config.model))[0]
    prompts = tuning_prompts(config.prompts, config.limit)
    doc = edge_profiles_doc(split_dir, prompts, config.max_new_tokens, args.threads or 2)
    return report(markdown(doc), write_results(doc, config.out))


def bench_main(args: argparse.Namespace) -> int:
    from splitlm.bench.prompts import default_prompts_path
    from splitlm.bench.report import markdown_report
    from splitlm.bench.specbench import load_prompt_set
    from splitlm.bench.suite import run_bench, write_results

    if args.pass_cost:
        return pass_cost_main(args)
    if args.prefill:
        return prefill_main(args)
    config = config_from_args(args)
    if args.edge_profiles:
        return edge_profiles_main(args, config)
    load_prompt_set(
        config.prompts or default_prompts_path(), config.categories, config.per_category, config.mode_questions
    )  # fail fast, before loading any model
    if config.vocab not in ("all", "en", "zh") and not Path(config.vocab).is_file():
        raise SplitLMError(f"--vocab {config.vocab!r}: not all, en, zh or an allow-list file")
    doc = run_bench(config)
    return report(markdown_report(doc), write_results(doc, config.out, plots=config.plots))
