"""docs/api.md's table of OpenAI request parameters and the parser agree: every row is in
`PARAMETERS` with the same route and status, every limited or refused one gets a 400 naming it,
every ignored one is accepted; request bodies with tools, response formats and logprobs parse into
what the edge runs, and bad ones are 400s that name the parameter."""

import re
from pathlib import Path

import pytest

from splitlm.edge.api_params import PARAMETERS
from splitlm.edge.api_requests import MAX_DEPTH, APIError, parse_chat, parse_completion
from splitlm.edge.api_tools import FunctionTool, read_calls

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ROW = re.compile(r"^\| `(\w+)` \| (chat|completions|both) \| (supported|limited|refused|ignored) \|")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
OPENAI_CHAT = {
    "model",
    "messages",
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "reasoning_effort",
    "response_format",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "web_search_options",
    "safety_identifier",
    "prompt_cache_key",
    "verbosity",
}
OPENAI_COMPLETIONS = {
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
}


def nested(depth: int) -> list:
    """A list `depth` levels deep."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def doc_table() -> dict[str, tuple[str, str]]:
    rows = {}
    section = DOC.read_text().split("## Request parameters", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        if m := ROW.match(line):
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def parse(endpoint: str, **fields):
    if endpoint == "chat":
        return parse_chat({**CHAT, **fields})
    return parse_completion({**COMPLETION, **fields}, vocab_size=256)


def rejects(endpoint: str, param: str, **fields) -> APIError:
    with pytest.raises(APIError) as e:
        parse(endpoint, **fields)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    return e.value


def test_the_docs_table_is_the_parsers():
    rows = doc_table()
    assert rows == {p.name: (p.endpoint, p.status) for p in PARAMETERS.values()}
    chat = {n for n, (route, _) in rows.items() if route in ("chat", "both")}
    completions = {n for n, (route, _) in rows.items() if route in ("completions", "both")}
    assert OPENAI_CHAT <= chat and OPENAI_COMPLETIONS <= completions  # every OpenAI parameter is listed


@pytest.mark.parametrize("p", list(PARAMETERS.values()), ids=lambda p: p.name)
def test_each_parameter_does_what_the_table_says(p):
    routes = ["chat", "completions"] if p.endpoint == "both" else [p.endpoint]
    if p.status in ("limited", "refused"):
        for route in routes:
            assert rejects(route, p.name, **{p.name: p.example}).code == "unsupported_parameter"
            for value in p.accepts:
                parse(route, **{p.name: value})  # the no-op defaults are taken
    if p.status == "ignored":
        for route in ("chat", "completions"):
            parse(route, **{p.name: "x"})
    other = {"chat": "completions", "completions": "chat"}.get(p.endpoint)
    if other and p.status != "ignored":
        example = p.example if p.example is not None else 1
        assert rejects(other, p.name, **{p.name: example}).code == "unsupported_parameter"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tools_and_formats_parse_into_grammars():
    req = parse("chat", tools=[WEATHER])
    assert req.tool_choice.mode == "auto" and req.grammar is None and req.reads_calls
    assert "get_weather" in req.messages[0]["content"] and req.messages[0]["role"] == "system"
    req = parse(
        "chat",
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    assert req.grammar.kind == "lark" and "%json" in req.grammar.source and req.grammar_param == "tools"
    assert not req.parallel_tool_calls and "call)*" not in req.grammar.source
    fmt = {"type": "json_schema", "json_schema": {"name": "P", "schema": {"type": "object"}, "strict": True}}
    assert parse("completions", response_format=fmt).grammar.kind == "json_schema"
    assert parse("chat", response_format={"type": "json_object"}).grammar.kind == "json_object"
    assert parse("chat", response_format={"type": "text"}).grammar is None
    assert parse("chat", logprobs=True, top_logprobs=3).logprobs == 3
    assert parse("chat", logprobs=True).logprobs == 0 and parse("chat").logprobs is None
    assert parse("completions", logprobs=2).logprobs == 2


def test_tool_parameters_are_an_object_schema():
    """Untyped parameters are taken as an object's (a forced call's arguments are one, and `tool_calls`
    only reads object arguments back)."""
    req = parse(
        "chat",
        tools=[
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}},
            }
        ],
        tool_choice="required",
    )
    assert req.tools[0].parameters == {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    assert '"arguments": {"type": "object"' in req.grammar.source


def test_calls_naming_no_string_are_not_calls():
    text = '<tool_call>\n{"name": ["f"], "arguments": {}}\n</tool_call>'
    assert read_calls(text, [FunctionTool("f")]) == (text, [])


def test_a_nested_body_within_the_limit_is_taken_and_mixed_prompts_are_not_many():
    parse("chat", user=nested(MAX_DEPTH - 1))  # in the body: MAX_DEPTH levels
    err = rejects("completions", "prompt", prompt=[1, "a"])
    assert "one prompt per request" not in err.message  # one prompt, of the wrong type


CALLED = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
]


def test_tool_turns_render_into_the_prompt():
    messages = [*CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    req = parse("chat", messages=messages, tools=[WEATHER])
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "user"]
    assert (
        req.messages[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert req.messages[3]["content"] == "<tool_response>\n12 C\n</tool_response>"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        # a tool's result answers a call just before it
        ({"messages": [{"role": "tool", "tool_call_id": "c1", "content": "x"}]}, "messages[0]"),
        (
            {
                "messages": [
                    *CALLED,
                    {"role": "user", "content": "and?"},
                    {"role": "tool", "tool_call_id": "call_1", "content": "x"},
                ]
            },
            "messages[3]",
        ),
        (
            {"messages": [*CALLED, {"role": "tool", "tool_call_id": "call_2", "content": "x"}]},
            "messages[2].tool_call_id",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0]",
        ),
        # what used to be 500s (unhashable values, a `$schema` jsonschema cannot look up, a window msgpack cannot send)
        ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}},
            "tool_choice",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$schema": 5}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": ["x"]}}}]},
            "tools[0].function.parameters",
        ),
        ({"cache_policy": "window:99999999999999999999"}, "cache_policy"),
        # a forced call's arguments must be a JSON object: a schema of another type could never be one
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        # text no tokenizer takes, and nesting deep enough to recurse past Python's limit later
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
        ({"stop": ["\udfff"]}, "stop"),
        ({"user": nested(MAX_DEPTH)}, "user"),
    ],
)
def test_bad_requests_name_the_parameter(fields, param):
    rejects("chat", param, **fields)
