"""Argument types and the option groups several commands share (edge, speculation, sampling), and
what the commands make of them."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitlm import SplitLMError
from splitlm.model.device import add_device_arguments

DEFAULT_PORT = 8765


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, with a readable error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def float_above(bound: float, inclusive: bool):
    """An argparse type: a number above `bound` (or equal to it, where `inclusive`), with a readable error."""
    relation = ">=" if inclusive else ">"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value >= bound if inclusive else value > bound) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a finite number {relation} {bound:g}, got {text}")
        return value

    return parse


non_negative_float = float_above(0.0, inclusive=True)
positive_float = float_above(0.0, inclusive=False)


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {value}")
    return value


def set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def need_edge_shard(args) -> None:
    """Apply `--threads`, and require `--edge` to be an existing shard directory."""
    set_threads(args.threads)
    if not Path(args.edge).is_dir():
        raise SplitLMError(f"edge shard {args.edge} not found")


def add_edge_security_options(p: argparse.ArgumentParser) -> None:
    """The edge's key options; `edge_config(args)` makes the `EdgeConfig` of an `Edge`."""
    p.add_argument(
        "--identity",
        metavar="KEY",
        default=None,
        help="this client's private key (from `splitlm keygen`; default: one kept in the config dir, "
        "$SPLITLM_CONFIG or ~/.config/splitlm)",
    )
    p.add_argument(
        "--cloud-key",
        metavar="PUB|FINGERPRINT",
        default=None,
        help="the cloud's public key file or SHA256: fingerprint to pin (default: trust on first use, "
        "recorded in the known_hosts file)",
    )
    p.add_argument(
        "--known-hosts",
        metavar="FILE",
        default=None,
        help="trust-on-first-use record (default: known_hosts in the config dir)",
    )
    p.add_argument(
        "--tls-ca",
        metavar="FILE",
        default=None,
        help="CA certificate(s) that sign a wss:// cloud's certificate (default: the system's)",
    )


def edge_config(args):
    """The `splitlm.edge.EdgeConfig` of `--wire-dtype` and the options of `add_edge_options` (keys, trust,
    what the cloud may keep and which tokens may be emitted)."""
    from splitlm.edge import EdgeConfig

    ping = getattr(args, "ping_interval", 20.0)
    return EdgeConfig(
        wire_dtype=getattr(args, "wire_dtype", "auto"),
        cache_policy=getattr(args, "cache_policy", None),
        identity=getattr(args, "identity", None),
        cloud_key=getattr(args, "cloud_key", None),
        known_hosts=getattr(args, "known_hosts", None),
        tls_ca=getattr(args, "tls_ca", None),
        vocab=getattr(args, "vocab", None) or "all",
        device=getattr(args, "device", "auto"),
        dtype=getattr(args, "dtype", "auto"),
        failover_timeout_s=getattr(args, "failover_timeout", 30.0),
        ping_interval_s=ping or None,
        prefill_chunk=getattr(args, "stream_prefill", "auto"),
        edge_adapter=getattr(args, "edge_adapter", None),
    )


def open_edge(args):
    """The `splitlm.edge.Edge` of `--edge`, `--cloud`, `--wire-dtype` and the options of `add_edge_options`."""
    from splitlm.edge import Edge

    return Edge(args.edge, args.cloud, edge_config(args))


def cache_policy_arg(text: str) -> str:
    from splitlm.transport.policy import CachePolicy

    try:
        return str(CachePolicy.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


WIRE_CHOICES = ["auto", "fp32", "fp16", "bf16", "int8", "fp8"]


def add_spec_option(p: argparse.ArgumentParser, what: str) -> None:
    """`--spec`: its choices and their help come from `splitlm.decoding.modes.SPEC_MODES`."""
    from splitlm.decoding.modes import SPEC_MODES

    modes = "; ".join(f"{m.name}: {m.help}" for m in SPEC_MODES.values())
    p.add_argument("--spec", default="auto", choices=list(SPEC_MODES), help=f"{what} (default auto). {modes}")


def spec_arg(args):
    """The SpecConfig of --spec and --pipeline."""
    from dataclasses import replace

    from splitlm.edge.runtime import as_spec

    return replace(as_spec(args.spec), pipeline=args.pipeline)


def add_pipeline_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="pipelined speculation: draft and send the next step while one is in flight, betting on "
        "its likeliest path (rolled back on a miss; same output). Pays at high RTT",
    )


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (default); > 0 samples, still several tokens per round trip with --spec "
        "(exact speculative sampling: the output is distributed as plain sampling)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 discourages tokens already in the context (default 1: off)",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability mass")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="sample among the k likeliest (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="same seed, same sampled output")


def sampling_config(args):
    from splitlm.decoding.sampling import SamplingConfig

    try:
        return SamplingConfig(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            repetition_penalty=args.repetition_penalty,
        )
    except ValueError as e:
        raise SplitLMError(str(e)) from None


CLOUD_HELP = "cloud URL ws://HOST:PORT; several, comma-separated, to fail over to (docs/failover.md)"


def add_edge_options(p: argparse.ArgumentParser) -> None:
    add_device_arguments(p, what="the edge's layers", onnx=True)
    p.add_argument(
        "--edge-adapter",
        metavar="PATH",
        default=None,
        help="a peft LoRA adapter directory of the full model (e.g. from `splitlm train-adapter`), merged "
        "into the edge's layers; it may change only what the edge holds and never leaves it",
    )
    p.add_argument(
        "--failover-timeout",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="how long a request keeps trying to reach a cloud after losing one (default 30)",
    )
    p.add_argument(
        "--ping-interval",
        type=non_negative_float,
        default=20.0,
        metavar="S",
        help="keepalive pings; a link that answers none for as long is dead (default 20, 0 = off)",
    )
    p.add_argument(
        "--wire-dtype",
        default="auto",
        choices=WIRE_CHOICES,
        help="activation codec on the wire (default auto: fp16, bf16 for Gemma; int8 and fp8 use per-row scales)",
    )
    p.add_argument(
        "--cache-policy",
        type=cache_policy_arg,
        default="session",
        metavar="{none,session,window:N,sealed}",
        help="what the cloud may keep between requests (default session; see README, cache policies)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads for this process")
    p.add_argument(
        "--stream-prefill",
        type=stream_prefill_arg,
        default="auto",
        metavar="{auto,off,N}",
        help="how a prompt goes up: auto (default) streams it in pipelined chunks when the measured "
        "link and compute say that is sooner; N: chunks of N tokens; off: in one forward",
    )
    add_vocab_option(p)
    add_edge_security_options(p)


def stream_prefill_arg(text: str) -> int | str:
    if text in ("auto", "off"):
        return 0 if text == "off" else "auto"
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected auto, off or a number of tokens > 0, not {text!r}")


def add_vocab_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vocab",
        default="all",
        metavar="{all,en,zh,FILE}",
        help="the token ids the model may emit: all (default), en (Latin script, digits, punctuation, "
        "code symbols), zh (en + Chinese), or a file of allowed ids; a split-head cloud computes "
        "logits for these only",
    )
