"""The `splitlm` command: one subcommand per job, each a thin layer over the Python API."""

from __future__ import annotations

import argparse

from splitlm import __version__
from splitlm.cli import audit, bench, demo, generate, models, serve, train
from splitlm.cli.options import edge_config, spec_arg
from splitlm.cli.output import add_common_options, configure_logging, run_command
from splitlm.result_files import begin_run

__all__ = ["build_parser", "edge_config", "main", "spec_arg"]

# the commands in the order `splitlm --help` lists them
ADD_PARSERS = (
    models.add_split,
    serve.add_serve_cloud,
    serve.add_keygen,
    generate.add_generate,
    serve.add_serve_edge,
    generate.add_chat,
    models.add_export_onnx,
    train.add_train_adapter,
    train.add_train_head,
    train.add_warmup,
    demo.add_demo,
    audit.add_audit_parsers,
    bench.add_bench_parsers,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitlm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"splitlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in ADD_PARSERS:
        add(sub)
    add_common_options(parser, sub)
    return parser


SERVER_COMMANDS = ("serve-cloud", "serve-edge", "wan")


def main(argv: list[str] | None = None) -> int:
    begin_run(None if argv is None else ["splitlm", *argv])  # the load average and command a result records
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose, args.quiet, timestamps=args.command in SERVER_COMMANDS)
    return run_command(args.func, args)
