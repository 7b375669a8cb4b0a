"""`splitlm demo`: split the bundled model (cached), start a cloud server, stream an answer."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from splitlm.cli.options import WIRE_CHOICES, positive_int
from splitlm.model.device import add_device_arguments

log = logging.getLogger(__name__)

DEMO_PROMPT = "In three short sentences, explain why sending text to a cloud model can leak private data."
WARMUP_PROMPT = "Write a Python function that returns the largest of three numbers."
WARMUP_TOKENS = 48


@dataclass
class DemoConfig:
    """What `splitlm demo` runs: the model, the question (None: a built-in one) and the answer's length,
    the wire codec, the emulated round trip, the drafter, and each side's device and dtype."""

    model: str = "default"
    prompt: str | None = None
    max_new_tokens: int = 96
    wire_dtype: str = "auto"
    rtt_ms: float = 80.0
    spec: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    cloud_device: str = "auto"
    cloud_dtype: str = "auto"


def run_demo(config: DemoConfig) -> int:
    import torch

    from splitlm.bench.wan import WanConfig, WanEmulator
    from splitlm.cloud.local import cloud_process
    from splitlm.edge import Edge, EdgeConfig
    from splitlm.edge.results import format_stats
    from splitlm.model.shards import cached_split
    from splitlm.transport.keys import default_identity

    split_dir = cached_split(config.model)
    cloud_key = default_identity("cloud").fingerprint  # the server below uses this identity; pin it
    log.info("splitlm demo: starting a cloud server on loopback (it holds only the middle layers)")
    with cloud_process(split_dir / "cloud", config.cloud_device, config.cloud_dtype) as port:
        torch.set_num_threads(1)
        log.info(
            f"splitlm demo: the edge reaches it through an emulated WAN link with {config.rtt_ms:.0f} ms round trips"
        )
        with (
            WanEmulator(("127.0.0.1", port), WanConfig(rtt_ms=config.rtt_ms)) as wan,
            Edge(
                split_dir / "edge",
                wan.url_for("ws"),
                EdgeConfig(wire_dtype=config.wire_dtype, cloud_key=cloud_key, device=config.device, dtype=config.dtype),
            ) as edge,
        ):
            # The step budget of `auto` learns the link's round trip and the cloud's cost per token from the
            # steps it runs (an edge that has served a request knows them); a first request starts untrained
            # and drafts too little. One short request first, as `bench` does before it measures.
            log_head(split_dir / "edge", edge.model.manifest.model_hash, config.spec)
            log.info(
                "splitlm demo: one short warm-up request first, so that the speculation budget knows the link "
                "(not shown)"
            )
            edge.generate(WARMUP_PROMPT, WARMUP_TOKENS, chat=True, spec=config.spec)
            prompt = config.prompt or DEMO_PROMPT
            print(f"> {prompt}\n", flush=True)
            stream = edge.stream(prompt, config.max_new_tokens, chat=True, spec=config.spec)
            for piece in stream:
                print(piece, end="", flush=True)
            print("\n")
            fast = stream.result.stats
            print(format_stats(fast), file=sys.stderr)
            log.info("splitlm demo: the same request with sequential decoding (one round trip per token) ...")
            slow = edge.generate(prompt, config.max_new_tokens, chat=True, spec="none").stats
            print(format_stats(slow), file=sys.stderr)
            if slow.tokens_per_s > 0:
                log.info(
                    f"splitlm demo: {config.spec} speculative decoding: {fast.tokens_per_round_trip:.2f} tokens per "
                    f"round trip, {fast.tokens_per_s / slow.tokens_per_s:.2f}x the sequential tok/s, same tokens"
                )
                log.info(
                    "splitlm demo: one prose answer; `splitlm bench` averages 20 prompts (code gains most, prose "
                    "least) on an idle machine: docs/results.md"
                )
    return 0


def log_head(edge_dir, model_hash: str, spec: str) -> None:
    """Say which draft head `auto` drafts with (and where it came from), or that it has none."""
    from splitlm.decoding.head import find_head, head_origin

    if spec not in ("auto", "head"):
        return
    path = find_head(edge_dir, model_hash)
    if path is None:
        log.info(
            "splitlm demo: no draft head for this model (`splitlm train-head` trains one): %s drafts without it", spec
        )
    else:
        log.info("splitlm demo: %s drafts with the draft head %s (%s)", spec, path, head_origin(path))


def cmd_demo(args) -> int:
    return run_demo(
        DemoConfig(
            args.model,
            args.prompt,
            args.max_new_tokens,
            args.wire_dtype,
            device=args.device,
            dtype=args.dtype,
            cloud_device=args.cloud_device or args.device,
            cloud_dtype=args.cloud_dtype or args.dtype,
        )
    )


def add_demo(sub) -> None:
    """The `demo` command's parser."""
    p = sub.add_parser("demo", help="split the bundled model, start a local cloud, stream an answer")
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--prompt", default=None, help="question to ask (default: a built-in one)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96, help="tokens of the answer at most")
    p.add_argument("--wire-dtype", default="auto", choices=WIRE_CHOICES, help="activation codec on the wire")
    add_device_arguments(p, what="the edge's (and, unless --cloud-device says otherwise, the cloud's) layers")
    add_device_arguments(p, "cloud", what="the cloud's layers")
    p.set_defaults(func=cmd_demo)
