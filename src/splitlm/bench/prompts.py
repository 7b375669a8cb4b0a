"""The benchmark's prompt set: load and check `benchmarks/prompts.json`, tokenize like the edge does.

Format: a JSON list of `{"id", "category", "prompt", "chat"}`; `chat: true` wraps the prompt in
the model's chat template (as `splitlm generate --chat` does), `false` continues the raw text. An
optional `schema` (a JSON schema) is what the answer must match: the `+json` modes constrain to it,
and every mode's answer is checked against it (`schema_valid`).
Spec-Bench's question file is read by `splitlm.bench.specbench`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from splitlm import SplitLMError

log = logging.getLogger(__name__)

CATEGORIES = ("code", "structured", "creative", "conversational")
DEFAULT_PROMPTS = Path("benchmarks") / "prompts.json"


@dataclass
class Prompt:
    id: str
    category: str
    prompt: str
    chat: bool = False
    ids: list[int] = field(default_factory=list)  # token ids, filled by `tokenize`
    skip_modes: frozenset[str] = field(default_factory=frozenset)  # modes that leave it out (Spec-Bench's caps)
    follows: str | None = None  # a later turn: the id of the turn it follows (its ids are filled once that is answered)
    schema: dict | None = None  # the JSON schema its answer must match (`benchmarks/prompts-json.json`; `+json` modes)


def default_prompts_path() -> Path:
    """`benchmarks/prompts.json` of the current directory, else of the source checkout."""
    if DEFAULT_PROMPTS.is_file():
        return DEFAULT_PROMPTS
    return Path(__file__).resolve().parents[3] / DEFAULT_PROMPTS


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read and check a prompt file; raise SplitLMError with the reason if it is unusable."""
    path = Path(path)
    if not path.is_file():
        raise SplitLMError(f"prompt file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SplitLMError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, list) or not data:
        raise SplitLMError(f"{path}: expected a non-empty JSON list of prompts")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for i, item in enumerate(data):
        where = f"{path}: prompt #{i}"
        if not isinstance(item, dict):
            raise SplitLMError(f"{where}: expected an object with id, category, prompt, chat")
        missing = [k for k in ("id", "category", "prompt") if not isinstance(item.get(k), str) or not item[k]]
        if missing:
            raise SplitLMError(f"{where}: missing or empty string field(s): {', '.join(missing)}")
        if not isinstance(item.get("chat", False), bool):
            raise SplitLMError(f"{where}: 'chat' must be true or false")
        if not isinstance(item.get("schema", {}), dict):
            raise SplitLMError(f"{where}: 'schema' must be a JSON schema object")
        if item["id"] in seen:
            raise SplitLMError(f"{where}: duplicate id {item['id']!r}")
        seen.add(item["id"])
        prompts.append(
            Prompt(item["id"], item["category"], item["prompt"], item.get("chat", False), schema=item.get("schema"))
        )
    return prompts


def load_tokenizer(tokenizer_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def tokenize(prompts: list[Prompt], tok) -> None:
    """Fill `Prompt.ids` the way the edge does (the chat template for chat prompts)."""
    from splitlm.edge.text import encode_prompt

    for p in prompts:
        if p.follows:  # a conversation's later turn: tokenized with the answer to the turn before
            continue
        if p.chat and not tok.chat_template:  # e.g. Gemma 3 270M's GGUF carries no template
            log.info("[bench] prompt %r: the model has no chat template; using the plain text", p.id)
            p.chat = False
        p.ids = encode_prompt(tok, p.prompt, p.chat)
        if not p.ids:
            raise SplitLMError(f"prompt {p.id!r} has no tokens")
