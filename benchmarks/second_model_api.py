"""The bundled model's API bars on the second built-in model (issue 58): chat, JSON-schema outputs, a
forced tool call and prefix reuse through serve-edge's OpenAI API, on Qwen2.5-Coder-1.5B-Instruct.

    .venv/bin/python benchmarks/second_model_api.py [--model qwen2.5-coder-1.5b] [--max-tokens 40]

One cloud and one edge (K = 2, M = 2, fp32 wire) in this process, two APIs over the edge: `auto` with
the prefix pool and `none` (sequential) without it, both greedy. Every request goes to both; each
check records both answers and whether they are equal, whether a JSON answer parses and fits its
schema, whether a forced call names a listed tool with arguments that fit its parameters, and how
many prompt tokens the second turn of a conversation reused. Writes `second-model-api-<stamp>.json`
(with provenance) to the results directory (the default results directory: copy a run to cite into
benchmarks/results); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import jsonschema
import openai

from splitlm.cloud.server import BackgroundServer
from splitlm.edge import Edge, EdgeConfig
from splitlm.edge.api import APIConfig, EdgeAPI
from splitlm.edge.api_serve import serving
from splitlm.edge.prefix_pool import PoolLimits
from splitlm.model.shards import cached_split
from splitlm.result_files import begin_run, default_results_dir, provenance, time_stamp, write_result

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "language": {"type": "string", "enum": ["python", "javascript", "go", "rust"]},
        "arguments": {"type": "array", "items": {"type": "string"}},
        "returns": {"type": "string"},
    },
    "required": ["name", "language", "arguments", "returns"],
    "additionalProperties": False,
}
TOOL_PARAMETERS = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "verbose": {"type": "boolean"}},
    "required": ["path"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite under a path and report failures",
            "parameters": TOOL_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]


def completion(client, model, messages, max_tokens, **kwargs):
    """(message, finish_reason, usage, seconds) of one greedy chat completion."""
    t0 = time.perf_counter()
    reply = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=max_tokens, **kwargs
    )
    choice = reply.choices[0]
    return choice.message, choice.finish_reason, reply.usage, round(time.perf_counter() - t0, 1)


def both(clients, model, messages, max_tokens, **kwargs) -> dict:
    """The request on the `auto` API and on the sequential one: both answers, their times, equality."""
    out = {}
    for name, client in clients.items():
        message, finish, usage, seconds = completion(client, model, messages, max_tokens, **kwargs)
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
        out[name] = {
            "content": message.content,
            "tool_calls": calls,
            "finish_reason": finish,
            "completion_tokens": usage.completion_tokens,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0,
            "seconds": seconds,
        }
    a, s = out["auto"], out["sequential"]
    out["identical"] = (a["content"], a["tool_calls"]) == (s["content"], s["tool_calls"])
    return out


def fits(instance, schema) -> bool:
    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError:
        return False
    return True


def run(args) -> dict:
    split = cached_split(args.model, head=2, tail=2)
    checks = {}
    with (
        BackgroundServer(split / "cloud") as cloud,
        Edge(split / "edge", cloud.url, EdgeConfig(wire_dtype="fp32", cloud_key=cloud.fingerprint)) as edge,
    ):
        apis = {
            "auto": EdgeAPI(edge, APIConfig(model_name=args.model, spec="auto")),
            "sequential": EdgeAPI(
                edge, APIConfig(model_name=args.model, spec="none", prefix_pool=PoolLimits(sessions=0))
            ),
        }
        with contextlib.ExitStack() as stack:
            clients = {
                name: openai.OpenAI(
                    base_url=stack.enter_context(serving(api.app, log_level="warning")) + "/v1",
                    api_key="none",
                    max_retries=0,
                    timeout=900,
                )
                for name, api in apis.items()
            }
            n = args.max_tokens
            chat = [
                {"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}
            ]
            checks["chat"] = both(clients, args.model, chat, n)
            checks["chat"]["ok"] = bool(checks["chat"]["auto"]["content"]) and checks["chat"]["identical"]

            describe = [
                {
                    "role": "user",
                    "content": "Describe the Python function `sorted` as JSON: its name, language, "
                    "arguments and what it returns.",
                }
            ]
            fmt = {"type": "json_schema", "json_schema": {"name": "function", "schema": SCHEMA}}
            c = checks["json_schema"] = both(clients, args.model, describe, 4 * n, response_format=fmt)
            try:
                c["valid"] = fits(json.loads(c["auto"]["content"]), SCHEMA)
            except (TypeError, json.JSONDecodeError):
                c["valid"] = False
            c["ok"] = c["valid"] and c["identical"]

            task = [{"role": "user", "content": "The tests in tests/api are failing. Find out why."}]
            c = checks["tool_call"] = both(clients, args.model, task, 2 * n, tools=TOOLS, tool_choice="required")
            calls = c["auto"]["tool_calls"]
            params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
            c["valid"] = bool(calls) and all(
                call["name"] in params and fits(json.loads(call["arguments"]), params[call["name"]]) for call in calls
            )
            c["ok"] = c["valid"] and c["identical"] and c["auto"]["finish_reason"] == "tool_calls"

            conversation = [
                {"role": "system", "content": "You are a terse senior engineer. Answer in at most three sentences."},
                {"role": "user", "content": "What does Python's GIL protect?"},
            ]
            first = both(clients, args.model, conversation, n)
            conversation += [
                {"role": "assistant", "content": first["auto"]["content"]},
                {"role": "user", "content": "And when does it not matter?"},
            ]
            c = checks["prefix_reuse"] = {"first": first, "second": both(clients, args.model, conversation, n)}
            c["reused_tokens"] = c["second"]["auto"]["cached_tokens"]
            c["ok"] = first["identical"] and c["second"]["identical"] and c["reused_tokens"] > 0
        for api in apis.values():
            api.close()
    return {
        "schema": "splitlm.second-model-api/1",
        "model": args.model,
        "split": {"head": 2, "tail": 2, "wire_dtype": "fp32"},
        "max_tokens": args.max_tokens,
        "checks": checks,
        "all_ok": all(c["ok"] for c in checks.values()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=40, help="per answer (JSON: 4x, tool call: 2x)")
    ap.add_argument("--out", default=None, help="results directory (default: benchmarks/results)")
    args = ap.parse_args()
    begin_run()
    created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc = {"created": created, **run(args)}
    doc["provenance"] = provenance()
    written = write_result(args.out or default_results_dir(), "second-model-api", doc, stamp=time_stamp(created))
    print(json.dumps({k: v["ok"] for k, v in doc["checks"].items()}), file=sys.stderr)
    print(written.json)
    return 0 if doc["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
