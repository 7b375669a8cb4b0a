"""OpenAI API request bodies -> checked generation requests.

What each OpenAI parameter gets is one table (`splitlm.edge.api_params.PARAMETERS`, docs/api.md
"Request parameters"): what the edge cannot honour (n > 1, penalties, audio, ...) is refused with a
400 naming it, never silently ignored; what cannot change the output (user, metadata, ...) is
ignored. `response_format` and forced tool calls become the request's grammar
(`splitlm.decoding.grammar`), applied on the edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitlm.decoding.grammar import GrammarSpec
from splitlm.decoding.logprobs import MAX_TOP_LOGPROBS
from splitlm.decoding.sampling import SamplingConfig
from splitlm.edge.api_errors import APIError, cloud_failure, invalid  # noqa: F401 (re-exported)
from splitlm.edge.api_params import check_params
from splitlm.edge.api_tools import (
    FunctionTool,
    ToolCall,
    ToolChoice,
    Turn,
    call_grammar,
    check_schema,
    parse_call_list,
    parse_tool_choice,
    parse_tools,
    plain_messages,
)
from splitlm.edge.text import TextCodec
from splitlm.transport.policy import CachePolicy

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOP = 4
LENGTH_MARGIN = 4  # a text may have this many times the characters its tokens could decode to (NFKC shrinks text)
MAX_DEPTH = 64  # objects and lists in a request body, one inside the next (OpenAI's schemas nest 10): more is a 400
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' `logprobs` (OpenAI's limit)


@dataclass
class APIRequest:
    model: str
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    prompt: str | list[int] | None = None  # completions: text or token ids
    max_tokens: int | None = None  # None = up to the context limit
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with the usage counts
    turns: list[Turn] = field(default_factory=list)  # chat: the messages as sent (tool calls and results kept)
    tools: list[FunctionTool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    grammar: GrammarSpec | None = None  # what the answer must follow: response_format, or a forced tool call
    grammar_param: str | None = None  # the parameter it comes from (named by a 400 when it does not compile)
    logprobs: int | None = None  # None: no logprobs; k: each token's and its k likeliest alternatives'
    cache_policy: CachePolicy | None = (
        None  # extra_body {"cache_policy": ...}; None: the server's (docs/prefix-reuse.md)
    )

    @property
    def forced_call(self) -> bool:
        """Whether the answer must be tool calls (`tool_choice` required, or a named function)."""
        return self.tool_choice.mode in ("required", "function")

    @property
    def reads_calls(self) -> bool:
        """Whether the answer is read for tool calls (any `tool_choice` but none)."""
        return self.tool_choice.mode != "none"


def check_json(body) -> None:
    """A 400 for a JSON body nested deeper than `MAX_DEPTH` or holding a lone UTF-16 surrogate
    (`"\\ud800"`, which no tokenizer or encoder takes), naming the top-level field it is in; checked
    without recursion, so that nothing later recurses past Python's limit."""
    items = list(body.items()) if isinstance(body, dict) else [(None, body)]
    stack = [(name, value, 1) for name, value in items]  # (top-level field, value, objects and lists around it)
    while stack:
        name, value, depth = stack.pop()
        if isinstance(value, dict | list) and depth >= MAX_DEPTH:
            raise APIError(
                400, f"the request body is nested deeper than {MAX_DEPTH} levels", param=name, code="invalid_json"
            )
        if isinstance(value, dict):
            stack += [(name, k, depth + 1) for k in value] + [(name, v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            stack += [(name, v, depth + 1) for v in value]
        elif isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise APIError(
                    400,
                    "the request body holds a lone UTF-16 surrogate, which is not text",
                    param=name,
                    code="invalid_json",
                ) from None


def check_length(chars: int, param: str, text: TextCodec, context_length: int) -> None:
    """A 400 before tokenizing a prompt of `chars` characters too long for the context whatever its
    tokens: tokenizing it would hold the tokenizer's lock, and so every other request, for seconds."""
    limit = LENGTH_MARGIN * text.longest_token * context_length
    if text.longest_token and chars > limit:
        raise invalid(
            param,
            f"the prompt has {chars} characters; the context holds {context_length} tokens, at most {limit} characters",
            "context_length_exceeded",
        )


def _number(body: dict, name: str, lo: float, hi: float, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(name, f"'{name}' must be a number, got {type(value).__name__}", "invalid_type")
    if not lo <= value <= hi:
        raise invalid(name, f"'{name}' must be between {lo} and {hi}, got {value}")
    return float(value)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"'{name}' must be an integer, got {type(value).__name__}", "invalid_type")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise invalid(name, f"'{name}' must be an integer {bound}, got {value}")
    return value


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    """`body[name]` as a boolean (absent or null: false); a 400 names `param` (default `name`)."""
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        param = param or name
        raise invalid(param, f"'{param}' must be a boolean, got {type(value).__name__}", "invalid_type")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop", "'stop' must be a string or a list of strings", "invalid_type")
    if len(stop) > MAX_STOP:
        raise invalid("stop", f"'stop' takes at most {MAX_STOP} strings, got {len(stop)}")
    return [s for s in stop if s]


def response_format(body: dict) -> GrammarSpec | None:
    """`response_format`: text (None), json_object, or json_schema {name, schema, strict} (a checked schema)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid(
            "response_format",
            "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema'}",
            "invalid_type",
        )
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return GrammarSpec.json_object()
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise invalid(
            "response_format.json_schema", "response_format.json_schema must be an object with a 'name'", "invalid_type"
        )
    if not isinstance(spec.get("strict", False), bool | None):
        raise invalid("response_format.json_schema.strict", "'strict' must be a boolean", "invalid_type")
    schema = spec.get("schema", {"type": "object"})
    check_schema(schema, "response_format.json_schema.schema")
    return GrammarSpec.json_schema(schema, spec["name"])


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprob comes with (None: no logprobs)."""
    if not chat:
        return _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


def _common(body: dict, default_temperature: float, chat: bool) -> APIRequest:
    check_json(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "you must provide a model parameter (a string)", "missing_required_parameter")
    check_params(body, "chat" if chat else "completions")
    temperature = _number(body, "temperature", 0.0, 2.0, default_temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise invalid("top_p", "'top_p' must be greater than 0")
    seed = _int(body, "seed", -(2**63), 2**64 - 1)
    sampling = SamplingConfig(
        temperature=temperature,
        top_p=top_p,
        top_k=_int(body, "top_k", 0) or 0,
        seed=None if seed is None else seed % 2**64,
    )
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 1) if max_tokens is None else max_tokens
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(options, dict):
            raise invalid("stream_options", "'stream_options' must be an object", "invalid_type")
    include_usage = stream and bool(options) and _bool(options, "include_usage", "stream_options.include_usage")
    grammar = response_format(body)
    return APIRequest(
        model,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        grammar=grammar,
        grammar_param=None if grammar is None else "response_format",
        logprobs=_logprobs(body, chat),
        cache_policy=_cache_policy(body),
    )


def _cache_policy(body: dict) -> CachePolicy | None:
    """What the request lets the cloud keep (none, session, window:N, sealed); None: not given."""
    value = body.get("cache_policy")
    if value is None:
        return None
    try:
        return CachePolicy.parse(value)
    except ValueError as e:
        raise invalid("cache_policy", str(e)) from None


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(
                    f"messages[{i}].content",
                    "only text content parts ({'type': 'text', 'text': ...}) are supported",
                    "unsupported_content",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(
        f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts", "invalid_type"
    )


def _turn(message, i: int) -> Turn:
    """One chat message: system / developer / user / assistant (text, or tool calls) / tool (a call's result)."""
    if not isinstance(message, dict):
        raise invalid(f"messages[{i}]", f"messages[{i}] must be an object", "invalid_type")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
    if role == "assistant" and message.get("tool_calls"):
        calls = parse_call_list(message["tool_calls"], f"messages[{i}].tool_calls")
        return Turn("assistant", "" if message.get("content") is None else _content(message, i), calls)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise invalid(
                f"messages[{i}].tool_call_id",
                f"messages[{i}] (role tool) needs a 'tool_call_id'",
                "missing_required_parameter",
            )
        return Turn("tool", _content(message, i), tool_call_id=call_id)
    return Turn(ROLES[role], _content(message, i))


def _check_tool_results(turns: list[Turn]) -> None:
    """Each `tool` message answers a call of the assistant message just before it (other results
    between them), as OpenAI requires; a call left unanswered is allowed."""
    calls: list[ToolCall] = []  # the calls the results that follow may answer
    for i, turn in enumerate(turns):
        if turn.role != "tool":
            calls = turn.tool_calls if turn.role == "assistant" else []
            continue
        if not calls:
            raise invalid(
                f"messages[{i}]",
                f"messages[{i}] (role tool) must answer a call of an assistant message with 'tool_calls' before it",
            )
        ids = {c.id for c in calls}
        if turn.tool_call_id not in ids and "" not in ids:  # a call sent back without an id: unchecked
            raise invalid(
                f"messages[{i}].tool_call_id",
                f"messages[{i}].tool_call_id {turn.tool_call_id!r} is "
                f"not one of the calls before it ({', '.join(sorted(map(repr, ids)))})",
            )


def _tools(body: dict, req: APIRequest) -> None:
    """`tools`, `tool_choice`, `parallel_tool_calls`; a forced call becomes the request's grammar."""
    req.tools = parse_tools(body)
    req.tool_choice = parse_tool_choice(body, req.tools)
    req.parallel_tool_calls = body.get("parallel_tool_calls") is None or _bool(body, "parallel_tool_calls")
    if req.forced_call:
        req.grammar = GrammarSpec.lark(call_grammar(req.tools, req.tool_choice, req.parallel_tool_calls))
        req.grammar_param = "tools"


def parse_chat(body, default_temperature: float = 1.0) -> APIRequest:
    """A /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    req = _common(body, default_temperature, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list", "missing_required_parameter")
    req.turns = [_turn(message, i) for i, message in enumerate(messages)]
    _check_tool_results(req.turns)
    _tools(body, req)
    req.messages = plain_messages(req.turns, req.tools)
    return req


def parse_completion(body, vocab_size: int, default_temperature: float = 1.0) -> APIRequest:
    """A /v1/completions body; the prompt is a string, a list of one string, or token ids."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    req = _common(body, default_temperature, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise invalid("prompt", f"token ids must be in [0, {vocab_size})")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise invalid("prompt", "only one prompt per request is supported", "unsupported_parameter")
    elif not isinstance(prompt, str) or not prompt:
        raise invalid(
            "prompt", "'prompt' must be a non-empty string or a list of token ids", "missing_required_parameter"
        )
    req.prompt = prompt
    return req
