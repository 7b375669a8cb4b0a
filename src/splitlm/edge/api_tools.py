"""Function calling in serve-edge: the request's `tools` and `tool_choice`, the conversation's
tool calls and results in the prompt, the grammar that forces a call, and the calls read back from
the model's text.

The calls' format is Hermes' (what Qwen2.5 and many open models are trained on): each call is a
JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` lines. A
chat template that takes `tools` (transformers' `apply_chat_template(..., tools=...)`) carries the
definitions itself; for one that does not (the bundled SmolLM2's), `tools_section` writes them into
the system prompt and asks for that format, assistant turns with calls are written in it and tool
results go back as user turns between `<tool_response>` tags (docs/api.md, "Tools").
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from splitlm.decoding.grammar import JSON_OPTIONS, closed_objects
from splitlm.edge.api_errors import invalid

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})  # JSON Schema

    def definition(self) -> dict:
        """The OpenAI definition (what a chat template and our system prompt show the model)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "none"  # none | auto | required | function
    name: str | None = None  # mode `function`: the one function to call


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_schema(schema, param: str) -> None:
    """A 400 naming `param` when `schema` is not a JSON Schema (by its own metaschema, `jsonschema`)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise invalid(param, f"'{param}' must be a JSON Schema object", "invalid_type")
    if not isinstance(schema.get("$schema", ""), str):  # jsonschema looks its metaschema up by this string
        raise invalid(param, f"'{param}' is not a valid JSON Schema: '$schema' must be a URI string", "invalid_schema")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise invalid(param, f"'{param}' is not a valid JSON Schema: {e.message}", "invalid_schema") from None


def _tool(item, i: int) -> FunctionTool:
    where = f"tools[{i}]"
    if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
        raise invalid(where, f"{where} must be {{'type': 'function', 'function': {{...}}}}", "invalid_type")
    fn = item["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(f"{where}.function.name", f"{where}.function.name must match {NAME.pattern}, got {name!r}")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"{where}.function.description", f"{where}.function.description must be a string", "invalid_type")
    parameters = fn.get("parameters")
    if parameters is None:
        return FunctionTool(name, description)
    check_schema(parameters, f"{where}.function.parameters")
    if parameters.get("type", "object") != "object":  # a call's arguments are a JSON object
        raise invalid(
            f"{where}.function.parameters",
            f"{where}.function.parameters must be a JSON Schema of type 'object', got type {parameters['type']!r}",
            "invalid_schema",
        )
    return FunctionTool(name, description, {"type": "object", **parameters})


def parse_tools(body: dict) -> list[FunctionTool]:
    """The request's `tools` (function definitions; names unique, parameters valid JSON Schemas)."""
    items = body.get("tools")
    if items is None:
        return []
    if not isinstance(items, list):
        raise invalid("tools", "'tools' must be a list", "invalid_type")
    if len(items) > MAX_TOOLS:
        raise invalid("tools", f"'tools' takes at most {MAX_TOOLS} functions, got {len(items)}")
    tools = [_tool(item, i) for i, item in enumerate(items)]
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools[{i}].function.name", f"the function name {name!r} is defined twice")
    return tools


def parse_tool_choice(body: dict, tools: list[FunctionTool]) -> ToolChoice:
    """`tool_choice`: none, auto (the default with tools), required, or {"type": "function", "function": {"name"}}."""
    choice = body.get("tool_choice")
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        mode, name = choice, None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        mode, name = "function", choice["function"].get("name")
        if name is None:
            raise invalid(
                "tool_choice.function.name",
                "tool_choice names no function: add 'function': {'name': ...}",
                "missing_required_parameter",
            )
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise invalid("tool_choice", f"tool_choice names the function {name!r}, which is not in 'tools'")
    else:
        raise invalid(
            "tool_choice",
            "'tool_choice' must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
        )
    if mode != "none" and not tools:
        raise invalid("tool_choice", "'tool_choice' is only allowed when 'tools' are specified")
    return ToolChoice(mode, name)


def parse_call_list(items, where: str) -> list[ToolCall]:
    """An assistant message's `tool_calls` (as a later request sends them back)."""
    if not isinstance(items, list):
        raise invalid(where, f"{where} must be a list", "invalid_type")
    calls = []
    for j, item in enumerate(items):
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise invalid(
                f"{where}[{j}]",
                f"{where}[{j}] must be {{'id', 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}",
                "invalid_type",
            )
        calls.append(ToolCall(fn["name"], fn["arguments"], str(item.get("id") or "")))
    return calls


# -- the prompt ------------------------------------------------------------------------------------


def tools_section(tools: list[FunctionTool]) -> str:
    """The system prompt's part that lists the functions, for a chat template without tool support."""
    lines = "\n".join(json.dumps(t.definition()) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n' + CALL_CLOSE
    )


def call_text(call: ToolCall) -> str:
    """One call as the model writes it (`arguments` parsed back where they are JSON)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': call.name, 'arguments': _arguments(call)})}\n{CALL_CLOSE}"


def _arguments(call: ToolCall):
    try:
        return json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments


@dataclass
class Turn:
    """One message of a chat request."""

    role: str  # system | user | assistant | tool
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of


def native_messages(turns: list[Turn]) -> list[dict]:
    """The turns for a chat template that takes `tools` (transformers' message format)."""
    out = []
    for t in turns:
        m: dict = {"role": t.role, "content": t.content}
        if t.tool_calls:
            m["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
                for c in t.tool_calls
            ]
        if t.tool_call_id is not None:
            m["tool_call_id"] = t.tool_call_id
        out.append(m)
    return out


def plain_messages(turns: list[Turn], tools: list[FunctionTool]) -> list[dict]:
    """The turns for a template of plain {"role", "content"} messages: the tools in the system prompt,
    calls in the assistant's text, results as user turns (consecutive ones merged)."""
    out: list[dict] = []
    for t in turns:
        if t.role == "tool":
            text = f"<tool_response>\n{t.content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
            continue
        content = "\n".join([t.content] * bool(t.content) + [call_text(c) for c in t.tool_calls])
        out.append({"role": t.role, "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


# -- the grammar of a forced call -----------------------------------------------------------------


def _renamed_refs(node, renames: dict[str, str]):
    """`node` with every `{"$ref": "#/$defs/X"}` of `renames` pointing at its new name."""
    if isinstance(node, dict):
        out = {k: _renamed_refs(v, renames) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/") and ref[8:] in renames:
            out["$ref"] = "#/$defs/" + renames[ref[8:]]
        return out
    if isinstance(node, list):
        return [_renamed_refs(v, renames) for v in node]
    return node


def call_schema(tools: list[FunctionTool]) -> dict:
    """A JSON Schema of one call `{"name", "arguments"}` to any of `tools`. Each function's `$defs`
    move to the root (where its `#/$defs/...` references resolve once the schema is nested), renamed
    `name.X` where two functions define X differently."""
    defs: dict = {}
    options = []
    for t in tools:
        params = closed_objects(t.parameters)
        own = params.pop("$defs", None) or {}
        renames = {k: f"{t.name}.{k}" for k, v in own.items() if k in defs and defs[k] != v}
        params = _renamed_refs(params, renames)
        defs.update({renames.get(k, k): _renamed_refs(v, renames) for k, v in own.items()})
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": JSON_OPTIONS}  # json.dumps' separators, as every JSON grammar of ours
    if defs:
        schema["$defs"] = defs
    return schema


def call_grammar(tools: list[FunctionTool], choice: ToolChoice, parallel: bool) -> str:
    """A Lark grammar (llguidance's, with `%json`) of the answer `required` or a named function
    forces: one call (or, with `parallel`, one or more, a line apart) whose arguments follow the
    function's parameter schema, and nothing else."""
    chosen = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    one = f'"{CALL_OPEN}\\n" %json {json.dumps(call_schema(chosen))} "\\n{CALL_CLOSE}"'
    more = ' ("\\n" call)*' if parallel else ""
    return f"start: call{more}\ncall: {one}\n"


# -- calls read back -----------------------------------------------------------------------------


def read_calls(text: str, tools: list[FunctionTool], parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """The content and the calls of a model's answer. Every `<tool_call>` block must be closed and
    hold a JSON object naming one of `tools` with object `arguments`; if any does not, there are no
    calls and the whole text is the content. Without `parallel` only the first call is kept."""
    calls = []
    names = {t.name for t in tools}
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or call["name"] not in names
            or not isinstance(call.get("arguments"), dict)
        ):
            return text, []
        calls.append(ToolCall(call["name"], json.dumps(call["arguments"])))
    content = CALL.sub("", text).strip()
    if not calls or CALL_OPEN in content:  # none, or one left open (cut by the length limit)
        return text, []
    return content or None, calls if parallel else calls[:1]


class CallFilter:
    """Streamed text with tool calls held back: `feed` returns what may be shown as content now (the
    text before anything that is, or could become, a `<tool_call>`); `finish` reads the held text."""

    def __init__(self, tools: list[FunctionTool], parallel: bool):
        self.tools, self.parallel = tools, parallel
        self.shown, self.held = "", ""

    def feed(self, piece: str) -> str:
        text = self.held + piece
        start = text.find(CALL_OPEN)
        if start < 0:  # hold back a tail that could begin one
            start = next(
                (i for i in range(max(0, len(text) - len(CALL_OPEN) + 1), len(text)) if CALL_OPEN.startswith(text[i:])),
                len(text),
            )
        out, self.held = text[:start], text[start:]
        self.shown += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest of the content, and the calls (none if the held text does not parse)."""
        if not self.held:
            return "", []
        _, calls = read_calls(self.shown + self.held, self.tools, self.parallel)
        if not calls:
            return self.held, []
        rest = CALL.sub("", self.held)
        return (rest.strip() if not self.shown.strip() else rest.rstrip()), calls


def template_input(turns: list[Turn], tools: list[FunctionTool], native: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages and `tools` for the chat template: transformers' format where the template lays
    out tools itself (`native`) and the conversation has any, else plain messages with ours."""
    if native and (tools or any(t.role == "tool" or t.tool_calls for t in turns)):
        return native_messages(turns), [t.definition() for t in tools] or None
    return plain_messages(turns, tools), None
