"""Every OpenAI request parameter of /v1/chat/completions and /v1/completions, and what serve-edge
does with it: `supported`, `limited` (one value, or values, honoured; any other is a 400),
`ignored` (it cannot change the output; the reason is in docs/api.md) or `refused` (a 400 naming
it, unless it holds its no-op default). docs/api.md, "Request parameters", is this table in prose;
tests/edge/test_api_params.py keeps the two in step. A parameter named by neither endpoint's table
(an SDK's extra field) is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitlm.edge.api_errors import invalid

STATUSES = ("supported", "limited", "ignored", "refused")
ENDPOINTS = ("chat", "completions", "both")


@dataclass(frozen=True)
class Param:
    name: str
    endpoint: str  # chat | completions | both
    status: str  # supported | limited | ignored | refused
    accepts: tuple = (None,)  # limited / refused: the values taken anyway (no-op defaults)
    example: object = None  # a value answered with 400 (limited / refused), for the tests

    def takes(self, value) -> bool:
        """Whether `value` is one this server honours (type-exact: True is not 1)."""
        return any(value is a or (type(value) is type(a) and value == a) for a in self.accepts)


def _p(name, endpoint, status, accepts=(None,), example=None) -> Param:
    return Param(name, endpoint, status, accepts, example)


PARAMETERS: dict[str, Param] = {
    p.name: p
    for p in [
        _p("model", "both", "supported"),
        _p("messages", "chat", "supported"),
        _p("prompt", "completions", "supported"),
        _p("max_tokens", "both", "supported"),
        _p("max_completion_tokens", "chat", "supported"),
        _p("temperature", "both", "supported"),
        _p("top_p", "both", "supported"),
        _p("top_k", "both", "supported"),
        _p("cache_policy", "both", "supported"),
        _p("seed", "both", "supported"),
        _p("stop", "both", "supported"),
        _p("stream", "both", "supported"),
        _p("stream_options", "both", "supported"),
        _p("response_format", "both", "supported"),
        _p("tools", "chat", "supported"),
        _p("tool_choice", "chat", "supported"),
        _p("parallel_tool_calls", "chat", "supported"),
        _p("logprobs", "both", "supported"),
        _p("top_logprobs", "chat", "supported"),
        _p("n", "both", "limited", (None, 1), 2),
        _p("best_of", "completions", "limited", (None, 1), 2),
        _p("modalities", "chat", "limited", (None, ["text"]), ["text", "audio"]),
        _p("frequency_penalty", "both", "refused", (None, 0, 0.0), 0.5),
        _p("presence_penalty", "both", "refused", (None, 0, 0.0), 0.5),
        _p("logit_bias", "both", "refused", (None, {}), {"50": 10}),
        _p("audio", "chat", "refused", (None,), {"voice": "alloy", "format": "wav"}),
        _p("reasoning_effort", "chat", "refused", (None,), "low"),
        _p("verbosity", "chat", "refused", (None,), "low"),
        _p("web_search_options", "chat", "refused", (None,), {}),
        _p("functions", "chat", "refused", (None, []), [{"name": "f", "parameters": {"type": "object"}}]),
        _p("function_call", "chat", "refused", (None, "none"), "auto"),
        _p("echo", "completions", "refused", (None, False), True),
        _p("suffix", "completions", "refused", (None, ""), "!"),
        _p("prediction", "chat", "ignored"),
        _p("store", "chat", "ignored"),
        _p("metadata", "chat", "ignored"),
        _p("service_tier", "both", "ignored"),
        _p("user", "both", "ignored"),
        _p("safety_identifier", "chat", "ignored"),
        _p("prompt_cache_key", "chat", "ignored"),
    ]
}


def check_params(body: dict, endpoint: str) -> None:
    """A 400 naming the first parameter of `body` this server does not honour on `endpoint`
    (`chat` or `completions`): a limited or refused one with another value than it takes, or one of
    the other endpoint's that would change the output."""
    for name, value in body.items():
        p = PARAMETERS.get(name)
        if p is None or value is None:
            continue
        if p.endpoint not in (endpoint, "both"):
            if p.status != "ignored":
                raise invalid(
                    name,
                    f"'{name}' is not a parameter of /v1/{endpoint.replace('chat', 'chat/completions')}",
                    "unsupported_parameter",
                )
        elif p.status in ("limited", "refused") and not p.takes(value):
            raise invalid(
                name,
                f"'{name}' = {value!r} is not supported by this server (docs/api.md, 'Request parameters')",
                "unsupported_parameter",
            )
