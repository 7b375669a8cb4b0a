"""OpenAI API request bodies -> checked generation requests; OpenAI-style error bodies.

Only what the edge can honour is accepted: a parameter it cannot (n > 1, tools, logprobs,
penalties, images) is refused with a 400 naming it, never silently ignored. Unknown extra fields
(user, metadata, ...) are ignored, as they change nothing about the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitlm.decoding.sampling import SamplingConfig
from splitlm.transport.errors import ErrorCode

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 4


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


CAPACITY_RETRY_AFTER_S = 2


def cloud_failure(e: Exception) -> APIError:
    """A failed generation: 503 with Retry-After when the cloud is at its KV capacity, else 502."""
    if getattr(e, "code", None) == ErrorCode.CAPACITY:
        return APIError(503, f"the cloud is at capacity: {e}", "server_error", code="cloud_capacity",
                        headers={"Retry-After": str(CAPACITY_RETRY_AFTER_S)})
    return APIError(502, f"the cloud failed: {e}", "server_error", code="cloud_error")


def invalid(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    model: str
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    prompt: str | list[int] | None = None  # completions: text or token ids
    max_tokens: int | None = None  # None = up to the context limit
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with the usage counts


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


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {type(value).__name__}", "invalid_type")
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


def _unsupported(body: dict, name: str, allowed=(None, False, 0, 0.0, [], {})) -> None:
    value = body.get(name)
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        raise invalid(name, f"'{name}' = {value!r} is not supported by this server", "unsupported_parameter")


def _common(body: dict, default_temperature: float) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "you must provide a model parameter (a string)", "missing_required_parameter")
    for name in ("presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias", "tools",
                 "functions", "echo", "suffix"):
        _unsupported(body, name)
    for name in ("n", "best_of"):
        _unsupported(body, name, (None, 1))
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise invalid("response_format", "only response_format {'type': 'text'} is supported", "unsupported_parameter")
    temperature = _number(body, "temperature", 0.0, 2.0, default_temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise invalid("top_p", "'top_p' must be greater than 0")
    seed = _int(body, "seed", -(2**63), 2**64 - 1)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=_int(body, "top_k", 0) or 0,
                              seed=None if seed is None else seed % 2**64)
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 1) if max_tokens is None else max_tokens
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(options, dict):
            raise invalid("stream_options", "'stream_options' must be an object", "invalid_type")
    include_usage = stream and bool(options) and _bool(options, "include_usage")
    return GenerationRequest(model, max_tokens=max_tokens, sampling=sampling, stop=_stop(body), stream=stream,
                             include_usage=include_usage)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content", "only text content parts ({'type': 'text', 'text': ...}) "
                              "are supported", "unsupported_content")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts",
                  "invalid_type")


def parse_chat(body, default_temperature: float = 1.0) -> GenerationRequest:
    """A /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    req = _common(body, default_temperature)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list", "missing_required_parameter")
    req.messages = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", f"messages[{i}] must be an object", "invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        req.messages.append({"role": ROLES[role], "content": _content(message, i)})
    return req


def parse_completion(body, vocab_size: int, default_temperature: float = 1.0) -> GenerationRequest:
    """A /v1/completions body; the prompt is a string, a list of one string, or token ids."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    req = _common(body, default_temperature)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise invalid("prompt", f"token ids must be in [0, {vocab_size})")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("prompt", "only one prompt per request is supported", "unsupported_parameter")
    elif not isinstance(prompt, str) or not prompt:
        raise invalid("prompt", "'prompt' must be a non-empty string or a list of token ids",
                      "missing_required_parameter")
    req.prompt = prompt
    return req
