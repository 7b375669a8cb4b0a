"""Text through a cloud from the terminal: `generate` (one prompt) and `chat` (a conversation)."""

from __future__ import annotations

import argparse
import json
import sys

from splitlm import SplitLMError
from splitlm.cli.options import (
    CLOUD_HELP,
    DEFAULT_PORT,
    add_edge_options,
    add_pipeline_option,
    add_sampling_options,
    add_spec_option,
    open_edge,
    positive_int,
    sampling_config,
    set_threads,
    spec_arg,
)
from splitlm.model.device import dtype_name


def cmd_generate(args) -> int:
    from splitlm.edge.request import GenerationRequest
    from splitlm.edge.results import format_stats

    set_threads(args.threads)
    sampling = sampling_config(args)
    prompt = read_prompt(args)
    grammar = grammar_arg(args)  # a missing or unreadable file is reported before the cloud is dialled
    with open_edge(args) as edge:
        stop_at_eos = not args.ignore_eos
        chat = args.chat if args.chat is not None else edge.text.has_chat_template
        request = GenerationRequest(
            prompt,
            args.max_new_tokens,
            chat,
            stop_at_eos,
            spec_arg(args),
            sampling,
            args.stop,
            response_format=grammar,
        )
        if args.json:
            result = edge.generate(request)
            print(
                json.dumps(
                    {
                        "text": result.text,
                        "token_ids": result.token_ids,
                        "prompt_tokens": len(result.prompt_ids),
                        "finish_reason": result.finish_reason,
                        "stats": result.stats.to_dict(),
                        "edge": {
                            "device": f"onnx:{edge.onnx}" if edge.onnx else str(edge.device),
                            "dtype": dtype_name(edge.dtype),
                        },
                    }
                )
            )
            return 0
        stream = edge.stream(request)
        for piece in stream:
            print(piece, end="", flush=True)
        print()
        print(format_stats(stream.result.stats), file=sys.stderr)
    return 0


def read_text(path: str, what: str) -> str:
    try:
        return open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise SplitLMError(f"cannot read the {what} {path}: {getattr(e, 'strerror', None) or e}") from None


def grammar_arg(args):
    """The `GrammarSpec` of --json-schema FILE, --json-object, --grammar FILE or --regex PATTERN (None: none)."""
    from splitlm.decoding.grammar import GrammarSpec

    if args.json_schema:
        return GrammarSpec.json_schema(read_text(args.json_schema, "JSON schema"))
    if args.json_object:
        return GrammarSpec.json_object()
    if args.grammar:
        return GrammarSpec.lark(read_text(args.grammar, "grammar file"))
    return GrammarSpec.regex(args.regex) if args.regex else None


def add_grammar_options(p: argparse.ArgumentParser) -> None:
    """Constrained decoding (docs/structured-outputs.md): at most one grammar."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this JSON Schema file")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument(
        "--grammar",
        metavar="FILE",
        help="the output matches this Lark grammar (llguidance's dialect: EBNF-like rules, /regex/ terminals)",
    )
    g.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression (Rust regex syntax)")


def read_prompt(args) -> str:
    """--prompt TEXT, --prompt - (stdin) or --prompt-file FILE."""
    if args.prompt_file is not None:
        try:
            text = open(args.prompt_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise SplitLMError(
                f"cannot read the prompt file {args.prompt_file}: {getattr(e, 'strerror', None) or e}"
            ) from None
    elif args.prompt == "-":
        text = sys.stdin.read()
    else:
        return args.prompt
    text = text.rstrip("\n")
    if not text.strip():
        raise SplitLMError("the prompt is empty")
    return text


def cmd_chat(args) -> int:
    from splitlm.cli.chat import run_chat

    set_threads(args.threads)
    sampling = sampling_config(args)
    with open_edge(args) as edge:
        return run_chat(
            edge, system=args.system, max_new_tokens=args.max_new_tokens, sampling=sampling, spec=spec_arg(args)
        )


def add_generate(sub) -> None:
    """The `generate` command's parser."""
    p = sub.add_parser("generate", help="generate text through a cloud server")
    p.add_argument("--edge", required=True, help="the edge shard directory (DIR/edge)")
    p.add_argument("--cloud", default=f"ws://127.0.0.1:{DEFAULT_PORT}", help=CLOUD_HELP)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt; '-' reads it from stdin")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the prompt from this UTF-8 file")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the model's chat template (default: when the tokenizer has one; "
        "--no-chat continues the text as it is)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate at most")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    add_pipeline_option(p)
    add_spec_option(p, "speculative decoding: several tokens per round trip, same greedy output")
    p.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="end the text before this string (repeatable)"
    )
    add_sampling_options(p)
    add_grammar_options(p)
    add_edge_options(p)
    p.set_defaults(func=cmd_generate)


def add_chat(sub) -> None:
    """The `chat` command's parser."""
    p = sub.add_parser("chat", help="chat in the terminal through a cloud server (streams, shows stats)")
    p.add_argument("--edge", required=True, help="the edge shard directory (DIR/edge)")
    p.add_argument("--cloud", default=f"ws://127.0.0.1:{DEFAULT_PORT}", help=CLOUD_HELP)
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="per answer (default 256)")
    add_sampling_options(p)
    add_pipeline_option(p)
    add_spec_option(p, "speculative decoding (greedy, or exact speculative sampling)")
    add_edge_options(p)
    p.set_defaults(func=cmd_chat)
