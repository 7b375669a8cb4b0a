"""The `splitlm` command: one subcommand per job, each a thin layer over the Python API."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from splitlm import SplitLMError, __version__

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


def set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def cmd_split(args) -> int:
    from splitlm.model.shards import split_model

    tail = args.tail if args.tail is not None else (0 if args.topology == "split-head" else 2)
    out = split_model(args.model, args.head, tail, args.out, args.dtype, args.topology, args.d_end)
    print(f"wrote {out / 'edge'} and {out / 'cloud'}")
    return 0


def cmd_serve_cloud(args) -> int:
    import asyncio

    from splitlm.cloud.server import CloudServer
    from splitlm.cloud.sessions import ServerLimits

    set_threads(args.threads)
    limits = ServerLimits(max_sessions=args.max_sessions, max_sessions_per_client=args.max_sessions_per_client,
                          max_tokens_per_session=args.max_tokens, idle_timeout_s=args.idle_timeout,
                          max_frame_bytes=args.max_frame_mb * 2**20)
    server = CloudServer(args.shard, limits, identity=args.identity, allowed_clients=args.clients,
                         tls_cert=args.tls_cert, tls_key=args.tls_key)
    try:
        asyncio.run(server.serve(args.host, args.port))
    except OSError as e:
        raise SplitLMError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    return 0


def cmd_generate(args) -> int:
    from splitlm.edge import Edge

    set_threads(args.threads)
    with Edge(args.edge, args.cloud, wire_dtype=args.wire_dtype, vocab=args.vocab,
              **edge_security_kwargs(args)) as edge:
        stop_at_eos = not args.ignore_eos
        if args.json:
            result = edge.generate(args.prompt, args.max_new_tokens, chat=args.chat, stop_at_eos=stop_at_eos,
                                   spec=args.spec)
            print(json.dumps({"text": result.text, "token_ids": result.token_ids, "prompt_tokens": len(result.prompt_ids),
                              "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}))
            return 0
        stream = edge.stream(args.prompt, args.max_new_tokens, chat=args.chat, stop_at_eos=stop_at_eos, spec=args.spec)
        for piece in stream:
            print(piece, end="", flush=True)
        print()
        print_stats(stream.result.stats)
    return 0


def print_stats(s) -> None:
    print(f"[{s.spec_mode}: {s.new_tokens} tokens, {s.round_trips} round trips, {s.tokens_per_round_trip:.2f} tokens/round trip, "
          f"TTFT {s.prefill_s * 1000:.0f} ms, {s.tokens_per_s:.1f} tok/s, "
          f"up {s.bytes_up / 1024:.1f} KiB, down {s.bytes_down / 1024:.1f} KiB]", file=sys.stderr)


def cmd_demo(args) -> int:
    from splitlm.demo import run_demo

    return run_demo(args.model, args.prompt, args.max_new_tokens, args.wire_dtype)


def cmd_keygen(args) -> int:
    from splitlm.transport.keys import generate_identity, write_identity

    identity = generate_identity()
    key_path, pub_path = write_identity(args.out, identity, comment=args.comment, force=args.force)
    print(f"wrote {key_path} (private, mode 0600) and {pub_path}", file=sys.stderr)
    print(identity.fingerprint)
    return 0


def add_edge_security_options(p: argparse.ArgumentParser) -> None:
    """The edge's key options; pass `edge_security_kwargs(args)` on to `Edge(...)`."""
    p.add_argument("--identity", metavar="KEY", default=None,
                   help="this client's private key (from `splitlm keygen`; default: one kept in the config dir, "
                        "$SPLITLM_CONFIG or ~/.config/splitlm)")
    p.add_argument("--cloud-key", metavar="PUB|FINGERPRINT", default=None,
                   help="the cloud's public key file or SHA256: fingerprint to pin (default: trust on first use, "
                        "recorded in the known_hosts file)")
    p.add_argument("--known-hosts", metavar="FILE", default=None,
                   help="trust-on-first-use record (default: known_hosts in the config dir)")
    p.add_argument("--tls-ca", metavar="FILE", default=None,
                   help="CA certificate(s) that sign a wss:// cloud's certificate (default: the system's)")


def edge_security_kwargs(args) -> dict:
    """Keyword arguments for `Edge(...)` from the options of `add_edge_security_options`."""
    return {name: getattr(args, name, None) for name in ("identity", "cloud_key", "known_hosts", "tls_ca",
                                                           "cache_policy")}


def cache_policy_arg(text: str) -> str:
    from splitlm.cloud.policy import CachePolicy

    try:
        return str(CachePolicy.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


WIRE_CHOICES = ["auto", "fp32", "fp16", "bf16", "int8", "fp8"]


def add_edge_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wire-dtype", default="auto", choices=WIRE_CHOICES,
                   help="activation codec on the wire (default auto: fp16, bf16 for Gemma; int8 and fp8 use "
                        "per-row scales)")
    p.add_argument("--cache-policy", type=cache_policy_arg, default="session", metavar="{none,session,window:N,sealed}",
                   help="what the cloud may keep between requests (default session; see README, cache policies)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads for this process")
    add_vocab_option(p)
    add_edge_security_options(p)


def add_vocab_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", default="all", metavar="{all,en,zh,FILE}",
                   help="the token ids the model may emit: all (default), en (Latin script, digits, punctuation, "
                        "code symbols), zh (en + Chinese), or a file of allowed ids; a split-head cloud computes "
                        "logits for these only")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitlm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"splitlm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("split", help="split a model into an edge shard and a cloud shard")
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--head", type=positive_int, default=2, help="layers [0, K) stay on the edge (default 2)")
    p.add_argument("--tail", type=non_negative_int, default=None,
                   help="layers [L-M, L) stay on the edge (default 2; split-head: 0)")
    p.add_argument("--topology", default="tail-local", choices=["tail-local", "split-head"],
                   help="tail-local (default): the edge keeps the last layers and the LM head; split-head: the cloud "
                        "runs every layer from K on and part of the LM head, the edge completes the logits")
    p.add_argument("--d-end", type=positive_int, default=None, metavar="D",
                   help="split-head: the LM head's columns [0, D) stay on the edge (default: half the hidden size)")
    p.add_argument("--out", required=True, help="output directory (gets edge/ and cloud/)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="weight dtype (default fp32)")
    p.set_defaults(func=cmd_split)

    p = sub.add_parser("serve-cloud", help="serve a cloud shard over WebSocket")
    p.add_argument("--shard", required=True, help="the cloud shard directory (DIR/cloud)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=non_negative_int, default=DEFAULT_PORT)
    p.add_argument("--max-sessions", type=positive_int, default=64)
    p.add_argument("--max-sessions-per-client", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=8192, help="KV entries per session")
    p.add_argument("--max-frame-mb", type=positive_int, default=64)
    p.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle session expires")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    p.add_argument("--identity", metavar="KEY", default=None,
                   help="the cloud's private key (from `splitlm keygen`; default: cloud.key in the config dir, "
                        "created on first use)")
    p.add_argument("--clients", metavar="FILE", default=None,
                   help="allowed client public keys, one per line (default: any client may connect, still encrypted)")
    p.add_argument("--tls-cert", metavar="PEM", default=None, help="serve wss:// with this certificate (chain)")
    p.add_argument("--tls-key", metavar="PEM", default=None, help="the TLS certificate's private key")
    p.set_defaults(func=cmd_serve_cloud)

    p = sub.add_parser("keygen", help="create a key pair: PREFIX.key (private) and PREFIX.pub")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.key (mode 0600) and PREFIX.pub")
    p.add_argument("--comment", default=None, help="comment at the end of the .pub line (default NAME@HOST)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("generate", help="generate text through a cloud server")
    p.add_argument("--edge", required=True, help="the edge shard directory (DIR/edge)")
    p.add_argument("--cloud", default=f"ws://127.0.0.1:{DEFAULT_PORT}", help="cloud URL (ws://HOST:PORT)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    p.add_argument("--spec", default="auto", choices=["none", "ngram", "lookahead", "auto"],
                   help="speculative decoding: several tokens per round trip, same greedy output (default auto)")
    add_edge_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="split the bundled model, start a local cloud, stream an answer")
    p.add_argument("--model", default="default")
    p.add_argument("--prompt", default=None, help="question to ask (default: a built-in one)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--wire-dtype", default="auto", choices=WIRE_CHOICES)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="benchmark split decoding behind an emulated WAN")
    from splitlm.bench.suite import add_bench_arguments, bench_main

    add_bench_arguments(p)
    p.set_defaults(func=bench_main)

    try:
        from splitlm.bench.wan import add_wan_arguments, wan_main
    except ImportError:
        pass
    else:
        p = sub.add_parser("wan", help="emulate a wide-area link: a delaying TCP proxy")
        add_wan_arguments(p)
        p.set_defaults(func=wan_main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "serve-cloud" else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)
    try:
        return args.func(args) or 0
    except SplitLMError as e:
        print(f"splitlm: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # bad values found after argument parsing (addresses, ranges)
        print(f"splitlm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
