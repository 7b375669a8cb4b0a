"""Text in and out of the edge: the shard's tokenizer (`TextCodec`, used under one lock: fast
tokenizers are not safe to call from several threads at once), prompts in the chat template, and
the text of a generation as it streams (`text_pieces`: stop strings cut it, their beginnings and
incomplete UTF-8 sequences are held back)."""

from __future__ import annotations

import functools
import json
import re
import secrets
import threading
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

from splitlm import SplitLMError
from splitlm.edge.results import GenerationResult, GenerationStats


def load_tokenizer(edge_dir: Path):
    """The shard's tokenizer (`transformers`), or None when it has none."""
    if not (edge_dir / "tokenizer.json").is_file() and not (edge_dir / "tokenizer.model").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(edge_dir)


def special_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special tokens (`<|im_start|>`, `<|endoftext|>`, ...)."""
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]


def render(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def content_pieces(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, from a message) pieces, in order, where every string of the
    messages and tools that holds a special token's text (a content, a call's argument, a tool's
    description) is a piece of its own. Such strings are found by rendering each as a unique mark;
    the real rendering must then be the marked one with each mark replaced by its string, as written
    or JSON-escaped (a template's `tojson`)."""
    specials = special_texts(tokenizer)
    marks: dict[str, str] = {}  # mark -> the string it stands for

    def marked(node):
        if isinstance(node, str):
            if not any(s in node for s in specials):
                return node
            mark = f"splitlm{secrets.token_hex(12)}"
            marks[mark] = node
            return mark
        if isinstance(node, dict):
            return {marked(k): marked(v) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return [marked(v) for v in node]
        return node

    marked_messages, marked_tools = marked(messages), marked(tools)
    text = render(tokenizer, messages, tools)
    if not marks:
        return [(text, False)]
    parts = re.split(f"({'|'.join(marks)})", render(tokenizer, marked_messages, marked_tools))
    pieces = _aligned(text, parts, marks)
    if pieces is None:
        raise SplitLMError(
            "a message holds a special token's text, which this model's chat template "
            "changes in a way that cannot be kept apart from its own; remove it"
        )
    return pieces


def _aligned(text: str, parts: list[str], marks: dict[str, str]) -> list[tuple[str, bool]] | None:
    """`text` cut as `parts` (the template's text and marks, alternating) cut the marked rendering,
    each mark's piece its string in one of the forms a template writes; None where they do not match."""
    pieces, pos = [], 0
    for i, part in enumerate(parts):
        if i % 2 == 0:  # the template's own text
            if not text.startswith(part, pos):
                return None
            pieces.append((part, False))
            pos += len(part)
            continue
        string = marks[part]
        forms = (string, json.dumps(string, ensure_ascii=False)[1:-1], json.dumps(string)[1:-1])
        form = next((f for f in forms if text.startswith(f, pos) and text.startswith(parts[i + 1], pos + len(f))), None)
        if form is None:
            return None
        pieces.append((form, True))
        pos += len(form)
    return [p for p in pieces if p[0]] if pos == len(text) else None


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation ([{"role", "content"}, ...]) in the tokenizer's chat template,
    ready for the assistant's next turn; `tools`: function definitions for a template that takes them.
    A special token's text inside a message (`<|im_start|>system` in a user's turn or a tool's
    result, a call's arguments, a tool's description) is tokenized as plain text: only the template
    itself opens and closes turns."""
    ids = []
    for text, from_message in content_pieces(tokenizer, messages, tools):
        ids += tokenizer(text, add_special_tokens=False, split_special_tokens=from_message).input_ids
    return ids


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt: raw text, or one user turn in the tokenizer's chat template."""
    if not chat:
        return tokenizer(prompt).input_ids
    return encode_messages(tokenizer, [{"role": "user", "content": prompt}])


def find_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` may not be shown yet: an incomplete UTF-8 sequence
    (decoded as U+FFFD) or the beginning of a stop string."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


class TextCodec:
    """The tokenizer of the shard in `edge_dir` (None without one) and the lock its users share."""

    def __init__(self, edge_dir: Path):
        self.edge_dir = edge_dir
        self.tokenizer = load_tokenizer(edge_dir)
        self.lock = threading.Lock()  # the tokenizer (and the tables of the edge's drafting state)

    @property
    def has_chat_template(self) -> bool:
        """Whether prompts can be wrapped in the model's chat template (what `--chat` defaults to)."""
        return self.tokenizer is not None and bool(self.tokenizer.chat_template)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise SplitLMError(f"{self.edge_dir} has no tokenizer; pass token ids instead of text")
        if chat and not self.tokenizer.chat_template:
            raise SplitLMError("this model's tokenizer has no chat template; drop --chat")
        with self.lock:
            return encode_prompt(self.tokenizer, prompt, chat)

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters of the longest vocabulary entry (0 without a tokenizer): no token decodes to more."""
        if self.tokenizer is None:
            return 0
        with self.lock:
            return max(map(len, self.tokenizer.get_vocab()), default=0)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template lays out function definitions itself (it reads `tools`)."""
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        return isinstance(template, str) and re.search(r"\btools\b", template) is not None

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation [{"role": "system"|"user"|"assistant", "content": str}, ...] in the
        chat template, ending where the assistant's next answer begins (`tools`: see `encode_messages`)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise SplitLMError("this model's tokenizer has no chat template")
        with self.lock:
            return encode_messages(self.tokenizer, messages, tools)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        """A prompt's token ids: given as ids, or text encoded (in the chat template with `chat`)."""
        ids = list(prompt) if isinstance(prompt, list | tuple) else self.encode(prompt, chat)
        if not ids:
            raise SplitLMError("the prompt is empty")
        return ids


def text_pieces(
    steps: Generator[tuple[list[int], GenerationStats], None, None],
    decode: Callable[[list[int]], str],
    prompt_ids: list[int],
    stop: str | list[str] | None = None,
    eos: set[int] | None = None,
    logprobs=None,
) -> Iterator[tuple[str, GenerationResult | None]]:
    """The text of a generation's `steps` (new token ids of each step, live stats): yields (new text,
    None) while decoding, then (last text, result). Text that could be the start of a stop string is
    held back until it is not; at a stop string the text is cut (finish reason `stop`, as when the
    last token is one of `eos`). `logprobs`: the request's `LogprobRecorder`, whose records the result takes."""
    stops = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]
    ids: list[int] = []
    text, sent = "", 0  # decoded text; how much of it was yielded
    stats = GenerationStats()
    finish = "length"
    try:
        for tokens, live_stats in steps:
            ids.extend(tokens)
            stats = live_stats
            text = decode(ids)
            cut = find_stop(text, stops)
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            safe = len(text) - held_back(text, stops)
            if safe > sent:
                yield text[sent:safe], None
                sent = safe
    finally:
        steps.close()
    if finish != "stop" and ids and ids[-1] in (eos or set()):
        finish = "stop"
    yield (
        text[sent:],
        GenerationResult(text, ids, stats, finish, prompt_ids, None if logprobs is None else list(logprobs.tokens)),
    )
