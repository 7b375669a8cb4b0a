"""OpenAI response bodies and streamed chunks of serve-edge."""

from __future__ import annotations

import json
import time

from splitlm.edge.api_answer import Answer, AnswerBuilder, Delta
from splitlm.edge.api_tools import ToolCall
from splitlm.edge.runtime import GenerationResult


def usage(result: GenerationResult) -> dict:
    n_prompt, n_out = len(result.prompt_ids), len(result.token_ids)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": result.stats.cached_tokens},
    }  # reused: docs/prefix-reuse.md


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def completion_body(
    rid: str,
    chat: bool,
    result: GenerationResult,
    model: str,
    fingerprint: str,
    answer: Answer | None = None,
    logprobs: dict | None = None,
) -> dict:
    """The whole response; `answer`: the content and tool calls read from the result (default: its text)."""
    answer = answer or Answer(result.text, [], result.finish_reason, None)
    if chat:
        message = {"role": "assistant", "content": answer.content, "refusal": None}
        if answer.tool_calls:
            message["tool_calls"] = [c.to_dict() for c in answer.tool_calls]
        choice = {"index": 0, "message": message, "finish_reason": answer.finish_reason, "logprobs": logprobs}
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": answer.finish_reason, "logprobs": logprobs}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [choice],
        "usage": usage(result),
        "splitlm": result.stats.to_dict(),
    }


def call_deltas(calls: list[ToolCall]) -> list[list[dict]]:
    """Streamed tool calls, OpenAI's way: per call a chunk's `tool_calls` with its index, id and name
    (arguments empty), then one with its arguments."""
    out = []
    for i, c in enumerate(calls):
        out.append([{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}])
        out.append([{"index": i, "function": {"arguments": c.arguments}}])
    return out


class Chunks:
    """The streamed chunks of one response."""

    def __init__(self, rid: str, chat: bool, model: str, fingerprint: str, answer: AnswerBuilder):
        self.rid, self.chat, self.model, self.fingerprint, self.answer = rid, chat, model, fingerprint, answer

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        role: bool = False,
        logprobs: dict | None = None,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        """One chunk: a piece of text (`role`: the chat's opening one), its logprobs, tool calls, or the end."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
        }

    def delta(self, delta: Delta) -> dict | None:
        """A streamed piece (None when it shows nothing: text held back as a possible tool call)."""
        if not delta.content and not delta.logprobs:
            return None
        return self.chunk(delta.content, logprobs=self.answer.logprobs_body(delta.logprobs, delta.offset))

    def last(self, include_usage: bool, result: GenerationResult) -> list[dict]:
        """After the text pieces: the text held back, the tool calls, the finish reason, the usage."""
        rest, end = self.answer.finish(result)
        out = [c for c in [self.delta(rest)] if c is not None]
        out += [self.chunk(None, tool_calls=calls) for calls in call_deltas(end.tool_calls)]
        out.append(self.chunk(None if self.chat else "", finish=end.finish_reason))
        if include_usage:
            last = self.chunk(None)
            last["choices"], last["usage"], last["splitlm"] = [], usage(result), result.stats.to_dict()
            out.append(last)
        return out
