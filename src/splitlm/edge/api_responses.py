"""OpenAI response bodies and streamed chunks of serve-edge."""

from __future__ import annotations

import json
import time

from splitlm.edge.runtime import GenerationResult


def usage(result: GenerationResult) -> dict:
    n_prompt, n_out = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def completion_body(rid: str, chat: bool, result: GenerationResult, model: str, fingerprint: str) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "finish_reason": result.finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint, "choices": [choice],
            "usage": usage(result), "splitlm": result.stats.to_dict()}


def chunk(rid: str, chat: bool, text: str | None, model: str, fingerprint: str, finish: str | None = None,
          role: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint, "choices": [choice]}
