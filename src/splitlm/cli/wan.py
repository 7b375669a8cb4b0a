"""`splitlm wan`: the WAN emulator (`splitlm.bench.wan`) as a standing proxy, until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging

from splitlm import SplitLMError
from splitlm.bench.wan import Address, WanConfig, as_address, format_address, parse_address, run_wan
from splitlm.cli.options import non_negative_float, positive_float


def _address_arg(text: str) -> Address:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_wan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``splitlm wan`` to ``parser``."""
    parser.add_argument(
        "--listen",
        type=_address_arg,
        default=("127.0.0.1", 9000),
        metavar="HOST:PORT",
        help="address to accept clients on (default: 127.0.0.1:9000)",
    )
    parser.add_argument("--upstream", type=_address_arg, required=True, metavar="HOST:PORT", help="server to relay to")
    parser.add_argument(
        "--rtt-ms",
        type=non_negative_float,
        required=True,
        metavar="MS",
        help="round-trip time to add; each direction gets half",
    )
    parser.add_argument(
        "--jitter-ms",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="uniform jitter per chunk and direction, +/- this much (default: 0)",
    )
    parser.add_argument(
        "--mbps",
        type=positive_float,
        default=None,
        metavar="MBIT",
        help="bandwidth cap per direction in Mbit/s (default: unlimited)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed for the jitter and the drops")
    parser.add_argument(
        "--drop-after-bytes",
        type=int,
        default=None,
        metavar="N",
        help="fault injection: cut the link once, after N bytes (both directions, all connections)",
    )
    parser.add_argument(
        "--drop-prob",
        type=float,
        default=0.0,
        metavar="P",
        help="fault injection: cut a connection at any chunk relayed with probability P (default 0)",
    )


def wan_main(args: argparse.Namespace) -> int:
    """Run ``splitlm wan`` until Ctrl-C; return the exit status. A bad value raises ValueError and a port
    it cannot listen on SplitLMError (the CLI's one error path reports them)."""
    config = WanConfig(
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        mbps=args.mbps,
        seed=args.seed,
        drop_after_bytes=args.drop_after_bytes,
        drop_prob=args.drop_prob,
    )
    listen, upstream = as_address(args.listen), as_address(args.upstream)
    if not logging.getLogger().handlers:  # called without the CLI's logging set-up: the banner still shows
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    banner = logging.getLogger("splitlm.bench.wan")  # the emulator's banner is this command's output
    if not banner.isEnabledFor(logging.INFO):
        banner.setLevel(logging.INFO)
    try:
        asyncio.run(run_wan(listen, upstream, config))
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        raise SplitLMError(f"cannot listen on {format_address(listen)}: {exc}") from None
    return 0
