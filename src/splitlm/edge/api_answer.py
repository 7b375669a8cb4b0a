"""One request's answer as serve-edge builds it: the content (tool calls held back and read out of
it), the tool calls, and each token's logprobs in the OpenAI shapes, streamed piece by piece or whole.

Logprobs go with the text they produced: a token is reported once the text shown so far reaches
into its bytes, and tokens past the answer's text (an end token, the tokens of a stop string) are
not reported, so a stream's logprobs join to the non-streamed ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from splitlm.decoding.logprobs import LogprobRecorder, TokenLogprob
from splitlm.edge.api_requests import APIRequest
from splitlm.edge.api_tools import CallFilter, ToolCall, read_calls
from splitlm.edge.results import GenerationResult
from splitlm.edge.text import TextCodec

BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte -> the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


BYTE_LEVEL = byte_level_alphabet()


class TokenBytes:
    """Each token id's bytes, through the tokenizer's vocabulary (byte-level BPE, `<0xNN>` byte
    tokens, SentencePiece's `▁`); special tokens have none. Without a tokenizer, every token is empty."""

    def __init__(self, text: TextCodec):
        self.text = text
        tok = text.tokenizer
        self.special = set(tok.all_special_ids) if tok is not None else set()
        backend = getattr(tok, "backend_tokenizer", None)
        self.byte_level = backend is not None and "ByteLevel" in str(backend.decoder)
        self.cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        if token not in self.cache:
            self.cache[token] = self.lookup(token)
        return self.cache[token]

    def lookup(self, token: int) -> bytes:
        tok = self.text.tokenizer
        if tok is None or token in self.special:
            return b""
        with self.text.lock:
            piece = tok.convert_ids_to_tokens(token)
        if piece is None:
            return b""
        if self.byte_level and all(c in BYTE_LEVEL for c in piece):
            return bytes(BYTE_LEVEL[c] for c in piece)
        if m := BYTE_TOKEN.match(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


def token_entry(token: int, logprob: float, nbytes: bytes) -> dict:
    return {"token": nbytes.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(nbytes)}


@dataclass
class Delta:
    """What one streamed chunk carries."""

    content: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0  # characters of the generated text before the first token of `logprobs` (completions)


@dataclass
class Answer:
    """A finished answer: the content (None when only calls), the calls, why it ended, its tokens' logprobs."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    logprobs: list[TokenLogprob] | None


class AnswerBuilder:
    """One request's answer, from its text pieces (streaming) or its whole result."""

    def __init__(self, req: APIRequest, chat: bool, token_bytes: TokenBytes):
        self.req, self.chat, self.token_bytes = req, chat, token_bytes
        self.recorder = None if req.logprobs is None else LogprobRecorder(req.logprobs)
        self.calls = CallFilter(req.tools, req.parallel_tool_calls) if chat and req.reads_calls else None
        self.shown_bytes = 0  # of the generated text, as streamed so far
        self.offset = 0  # characters of the text before the next token to report
        self.reported = 0  # tokens whose logprobs went out
        self.tokens_bytes = 0  # bytes of the first `reported` tokens

    def covered(self, n_bytes: int) -> list[TokenLogprob]:
        """The tokens not yet reported that the first `n_bytes` of the text reach into."""
        if self.recorder is None:
            return []
        records = self.recorder.tokens
        start = self.reported
        if self.token_bytes.text.tokenizer is None:  # no text: every token counts
            self.reported = len(records)
        while self.reported < len(records) and self.tokens_bytes < n_bytes:
            self.tokens_bytes += len(self.token_bytes(records[self.reported].token))
            self.reported += 1
        return records[start : self.reported]

    def delta(self, content: str, n_bytes: int) -> Delta:
        """A chunk's content and the logprobs of the tokens the text's first `n_bytes` newly reach."""
        records = self.covered(n_bytes)
        delta = Delta(content, records, self.offset)
        self.offset += sum(len(self.token_bytes(r.token).decode("utf-8", "replace")) for r in records)
        return delta

    def piece(self, text: str) -> Delta:
        """A piece of generated text (in the worker thread, as it comes): what the stream shows now."""
        self.shown_bytes += len(text.encode())
        shown = text if self.calls is None else self.calls.feed(text)
        return self.delta(shown, self.shown_bytes)

    def finish(self, result: GenerationResult) -> tuple[Delta, Answer]:
        """After the stream: its last content and logprobs, and the answer (for its calls and finish)."""
        rest, calls = ("", []) if self.calls is None else self.calls.finish()
        delta = self.delta(rest, len(result.text.encode()))
        return delta, Answer(None, calls, "tool_calls" if calls else result.finish_reason, None)

    def whole(self, result: GenerationResult) -> Answer:
        """The non-streamed answer."""
        content, calls = result.text, []
        if self.calls is not None:
            content, calls = read_calls(result.text, self.req.tools, self.req.parallel_tool_calls)
        logprobs = None if self.recorder is None else self.covered(len(result.text.encode()))
        return Answer(content, calls, "tool_calls" if calls else result.finish_reason, logprobs)

    # -- OpenAI shapes ------------------------------------------------------------------------------
    def chat_logprobs(self, records: list[TokenLogprob]) -> dict:
        """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}."""
        tb = self.token_bytes
        content = [
            {
                **token_entry(r.token, r.logprob, tb(r.token)),
                "top_logprobs": [token_entry(t, lp, tb(t)) for t, lp in r.top],
            }
            for r in records
        ]
        return {"content": content, "refusal": None}

    def completion_logprobs(self, records: list[TokenLogprob], offset: int = 0) -> dict:
        """{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}; `offset`: the
        characters of text before the first record."""
        tb = self.token_bytes
        tokens = [tb(r.token).decode("utf-8", "replace") for r in records]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{tb(t).decode("utf-8", "replace"): lp for t, lp in r.top} for r in records],
            "text_offset": offsets,
        }

    def logprobs_body(self, records: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        """The choice's `logprobs` for `records` (None when the request asked for none)."""
        if self.recorder is None or records is None:
            return None
        return self.chat_logprobs(records) if self.chat else self.completion_logprobs(records, offset)
