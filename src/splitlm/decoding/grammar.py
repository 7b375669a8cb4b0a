"""Grammars that constrain what the edge may emit: JSON (any object, or one JSON Schema), a regular
expression or a Lark (EBNF) grammar, compiled for the model's tokenizer by `llguidance`.

    spec = GrammarSpec.json_schema({"type": "object", "properties": {...}})
    grammar = compile_grammar(spec, GrammarTokenizer.from_hf(tokenizer, vocab_size, eos_ids))
    state = grammar.start()          # one per request
    state.allowed()                  # [V] bool: the tokens the grammar allows next
    state.advance(token); state.rollback(1)

A state whose continuation the grammar fixes *forces* its next token (`forced`): llguidance's
fast-forward tokens (the tokenizer's own split of the forced bytes), or the end token once the
grammar is complete. A forced state allows that token only, so "argmax over the allowed tokens"
emits it whatever the model says: sequential constrained decoding and grammar-aware speculation
(`splitlm.decoding.grammar_decode`) agree token for token. JSON grammars emit `json.dumps`'
separators (`", "`, `": "`) and no other whitespace: the keys, quotes and punctuation between values
are then forced, up to bytes a longer token could begin with (the ` "` that opens a string: ` ""`
begins with it too). Those are only `likely`: the tokenizer's split of them, for the model to confirm.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from splitlm import SplitLMError

log = logging.getLogger(__name__)

# the kinds of grammar, and how messages name them
KIND_NAMES = {
    "json_object": "JSON object grammar",
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "lark": "Lark grammar",
}
GRAMMAR_KINDS = tuple(KIND_NAMES)
# JSON as json.dumps writes it: fixed separators, no other whitespace (more of it is forced)
# tried in this order to finish a JSON document in few tokens: close the string, the object, the array;
# else go on to the next key; an empty or smallest value
CLOSERS = ('"', "}", "]", ",", "0", "1", "[", "{", "false", "null")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# a JSON string's closing quote as the tokenizer merges it with what follows (`",` before the next key)
VALUE_ENDS = ('",', '"}', '"]', '"},', '"],', '"}]', '"]}', '"}}')
SPACE_LED, PUNCT_LED = 1, 2  # `GrammarTokenizer.leads`: how a token's text begins
PUNCTUATION = b".,;:()"


class GrammarError(SplitLMError):
    """A grammar the engine cannot compile (or a response format it cannot read)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match.

    kind: json_object (any JSON object), json_schema (`source`: the schema as JSON text), regex
    (`source`: the pattern, Rust `regex` syntax, matched against the whole output) or lark (`source`:
    a Lark grammar, llguidance's dialect, which also takes GBNF/EBNF-like rules and embedded `%json`)."""

    kind: str
    source: str = ""
    name: str | None = None  # a label for messages (an OpenAI response_format's schema name)

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (choose from {', '.join(GRAMMAR_KINDS)})")

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict | str, name: str | None = None) -> GrammarSpec:
        """From a schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be a JSON object")
        return cls("json_schema", json.dumps(schema), name)  # key order kept: it is the output's

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls("lark", grammar)

    @property
    def schema(self) -> dict | None:
        """The JSON schema the output validates against (json_object: any object), else None."""
        if self.kind == "json_object":
            return {"type": "object"}
        return json.loads(self.source) if self.kind == "json_schema" else None


def grammar_from_format(fmt: Any) -> GrammarSpec | None:
    """A `GrammarSpec` from what `Edge.generate(response_format=...)` takes: a GrammarSpec; a pydantic
    model class (its JSON schema); an OpenAI `response_format` dict (`{"type": "text" | "json_object"}`
    or `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`); any other dict is a
    JSON schema itself. None (or type text): unconstrained."""
    if fmt is None or isinstance(fmt, GrammarSpec):
        return fmt
    if isinstance(fmt, type) and hasattr(fmt, "model_json_schema"):  # a pydantic model class
        return GrammarSpec.json_schema(fmt.model_json_schema(), fmt.__name__)
    if not isinstance(fmt, dict):
        raise GrammarError(
            "response_format must be a JSON schema (dict), a pydantic model class, "
            f"an OpenAI response_format or a GrammarSpec, not {type(fmt).__name__}"
        )
    kind = fmt.get("type")
    if kind == "text" and len(fmt) == 1:
        return None
    if kind == "json_object" and len(fmt) == 1:
        return GrammarSpec.json_object()
    if kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        inner = fmt["json_schema"]
        if not isinstance(inner.get("schema"), dict):
            raise GrammarError("response_format.json_schema.schema must be a JSON schema object")
        return GrammarSpec.json_schema(inner["schema"], inner.get("name"))
    return GrammarSpec.json_schema(fmt)


@dataclass(frozen=True)
class GrammarTokenizer:
    """The model's tokenizer as the grammar engine sees it (building it takes ~0.3 s on a 49k
    vocabulary: make it once per tokenizer)."""

    ll: Any  # llguidance.LLTokenizer
    vocab_size: int  # V: the model's (token ids >= the tokenizer's size are never allowed)
    eos: tuple[int, ...]  # the end tokens; a complete grammar forces the first
    closers: tuple[int, ...] = ()  # single tokens of `CLOSERS`, in its order (`GrammarState.closing`)
    value_ends: tuple[int, ...] = ()  # single tokens of `VALUE_ENDS`
    word_ends: np.ndarray | None = field(default=None, compare=False)  # [V] bool: the text ends in a letter or digit
    leads: np.ndarray | None = field(default=None, compare=False)  # [V] int8: SPACE_LED, PUNCT_LED or 0

    @classmethod
    def from_hf(cls, tokenizer, vocab_size: int, eos_ids: list[int] | tuple[int, ...]) -> GrammarTokenizer:
        """From a fast `transformers` tokenizer."""
        if not eos_ids:
            raise GrammarError("constrained decoding needs the model's end token (its config names none)")
        try:
            ll = text_tokenizer(tokenizer, vocab_size, eos_ids)
        except (ValueError, RuntimeError, AttributeError) as e:
            raise GrammarError(f"the grammar engine cannot read this tokenizer: {e}") from None

        def single(texts: tuple[str, ...]) -> tuple[int, ...]:
            return tuple(ids[0] for c in texts if len(ids := ll.tokenize_str(c)) == 1 and ids[0] < vocab_size)

        texts = [ll.decode_bytes([t]) if t < ll.vocab_size else b"" for t in range(vocab_size)]
        word_ends = np.array([bool(b) and (b[-1:].isalnum() or b[-1] >= 0x80) for b in texts])  # UTF-8: a letter
        leads = np.array(
            [SPACE_LED if b[:1] == b" " else PUNCT_LED if b[:1] and b[:1] in PUNCTUATION else 0 for b in texts],
            dtype=np.int8,
        )
        return cls(ll, vocab_size, tuple(eos_ids), single(CLOSERS), single(VALUE_ENDS), word_ends, leads)


def text_tokenizer(tokenizer, vocab_size: int, eos_ids) -> Any:
    """The engine's tokenizer (an `llguidance.LLTokenizer`) from a fast `transformers` one, without its added
    tokens but the end tokens. The engine takes every added token for a special one, which no text of a
    grammar matches, yet splits text into them: the forced `<tool_call>` of a tool call would come out
    as Qwen's special token of that name and fail the match. Without them text splits into the plain
    tokens that spell it, and the added ones (chat markers, Qwen's `<tool_call>`) are never allowed."""
    import copy
    import json

    import llguidance

    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["id"] in eos_ids]
    return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=list(eos_ids))


# keywords whose value is a subschema, a list of them, or a map of names to them
_ONE_SUBSCHEMA = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# an object schema with any of these says more about which keys it takes than its `properties` do
_OPENS_KEYS = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "if",
    "dependentSchemas",
)


def closed_objects(schema):
    """`schema` with every object that lists its `properties`, and says nothing else about which keys
    it takes, closed to other keys (`additionalProperties: false`), as xgrammar (vLLM's default) and
    OpenAI's strict mode have it: a model left free to add keys invents them until the length limit.
    An answer to the closed schema validates against `schema`; `allOf` branches are left as they are
    (closing one would refuse its siblings' keys)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE_SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and not any(k in schema for k in _OPENS_KEYS):
        out["additionalProperties"] = False
    return out


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for `spec` (not yet checked)."""
    from llguidance import LLMatcher

    if spec.kind in ("json_object", "json_schema"):
        try:
            return LLMatcher.grammar_from_json_schema(closed_objects(spec.schema), overrides=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"cannot compile the JSON schema: {e}") from None
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    return LLMatcher.grammar_from_lark(spec.source)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar for one tokenizer; `start()` gives each request its own state."""

    spec: GrammarSpec
    text: str  # llguidance's grammar
    tokenizer: GrammarTokenizer

    def start(self) -> GrammarState:
        return GrammarState(self)


def compile_grammar(spec: GrammarSpec, tokenizer: GrammarTokenizer) -> Grammar:
    """Compile and check `spec` for `tokenizer`; GrammarError with the engine's message if it cannot."""
    from llguidance import LLMatcher

    text = grammar_text(spec)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(text, tokenizer.ll)
    what = KIND_NAMES[spec.kind] + (f" {spec.name!r}" if spec.name else "")
    if is_error:
        raise GrammarError(f"cannot compile the {what}: {messages[0] if messages else 'invalid grammar'}")
    for m in messages:
        log.warning("%s: %s", what, m)
    grammar = Grammar(spec, text, tokenizer)
    probe = LLMatcher(tokenizer.ll, text, log_level=0)
    if probe.is_error():
        raise GrammarError(f"cannot compile the {what}: {probe.get_error()}")
    return grammar


def mask_words(vocab_size: int) -> int:
    """int32 words of one packed mask row."""
    return (vocab_size + 31) // 32


def unpack_masks(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    """Packed mask rows [N, W] int32 (bit j of word i: token 32·i + j) -> [N, V] bool."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))


def allows(row: np.ndarray, token: int) -> bool:
    """Whether packed mask `row` [W] allows `token`."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


class GrammarState:
    """Where one request stands in its grammar: the tokens consumed so far (a `llguidance.LLMatcher`)."""

    def __init__(self, grammar: Grammar):
        from llguidance import LLMatcher

        self.grammar = grammar
        self.vocab_size = grammar.tokenizer.vocab_size
        self.eos = grammar.tokenizer.eos
        self.matcher = LLMatcher(grammar.tokenizer.ll, grammar.text, log_level=0)
        self.consumed = 0
        self.ended = False  # an end token was consumed

    def forced(self) -> int | None:
        """The one token the grammar allows next (None: a choice is left to the model)."""
        if self.ended or self.matcher.is_stopped():
            return self.eos[0]
        ff = self.matcher.compute_ff_tokens()
        return ff[0] if ff else None

    def fill_mask(self, row: np.ndarray) -> int | None:
        """Write the allowed tokens into `row` ([W] int32, packed) and return the forced token, if any
        (then the row allows it alone)."""
        forced = self.forced()
        if forced is None:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            self.check()
        else:
            row[:] = 0
            row[forced >> 5] = np.int32(np.uint32(1 << (forced & 31)).view(np.int32))
        return forced

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        row = np.zeros(mask_words(self.vocab_size), dtype=np.int32)
        self.fill_mask(row)
        return unpack_masks(row[None], self.vocab_size)[0]

    def forced_chain(self, limit: int) -> list[int]:
        """The tokens the grammar forces from here on, one after another (at most `limit`, stopping
        after an end token); the state is left where it was."""
        return self.expected_chain(limit, guess=False)[0]

    def likely(self) -> int | None:
        """Where no token is forced but the grammar fixes the next bytes (`": "` and a string's quote:
        the tokenizer could split them more than one way, so no token is forced), the first token of
        the tokenizer's own split of those bytes, if allowed: a guess, the model may split otherwise."""
        if self.forced() is not None:
            return None
        fixed = self.matcher.compute_ff_bytes()
        tokens = self.grammar.tokenizer.ll.tokenize_bytes(fixed) if fixed else []
        return tokens[0] if tokens and self.matcher.validate_tokens(tokens[:1]) == 1 else None

    def expected_chain(self, limit: int, guess: bool = True) -> tuple[list[int], int]:
        """The forced chain, then (with `guess`, where it stops at a `likely` token) that token and what
        is forced or likely after it: (at most `limit` tokens, stopping after an end token; how many
        come before the first guess). The state is left where it was."""
        chain: list[int] = []
        certain = None
        while len(chain) < limit:
            tok = self.forced()
            if tok is None:
                tok = self.likely() if guess else None
                if tok is None:
                    break
                certain = len(chain) if certain is None else certain
            self.advance(tok)
            chain.append(tok)
            if tok in self.eos:
                break
        self.rollback(len(chain))
        return chain, len(chain) if certain is None else certain

    def closing(self, limit: int) -> list[int] | None:
        """A short way to complete the output from here (the end token excluded): the forced token, else
        the first allowed of the tokenizer's `CLOSERS`, else the lowest allowed token, until the output
        is a complete match; None if that takes more than `limit` tokens. Deterministic: the same state
        gives the same closing. The state is left where it was."""
        closers = self.grammar.tokenizer.closers
        row = np.zeros(mask_words(self.vocab_size), dtype=np.int32)
        path: list[int] = []
        try:
            while not self.accepting:
                if len(path) >= limit:
                    return None
                forced = self.fill_mask(row)
                tok = forced if forced is not None else next((c for c in closers if allows(row, c)), None)
                if tok is None:
                    words = np.flatnonzero(row)
                    if not len(words):
                        return None
                    bits = int(row[words[0]]) & 0xFFFFFFFF
                    tok = 32 * int(words[0]) + (bits & -bits).bit_length() - 1
                if tok in self.eos:
                    return None
                self.advance(tok)
                path.append(tok)
            return path
        finally:
            self.rollback(len(path))

    def advance(self, token: int) -> None:
        """Consume `token`; GrammarError if the grammar does not allow it. An end token is taken where
        the output is a complete match (the engine itself is not told: it ends nothing to roll back)."""
        if self.ended:
            raise GrammarError("no token may follow the end token")
        if token in self.eos:
            if not self.matcher.is_accepting():
                raise GrammarError("the end token came before the output matched the grammar")
            self.ended = True
        elif not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not match the grammar: {self.matcher.get_error()}")
        self.consumed += 1

    def rollback(self, n: int = 1) -> None:
        """Undo the last `n` tokens consumed."""
        if n and self.ended:
            self.ended, n, self.consumed = False, n - 1, self.consumed - 1
        if n:
            self.matcher.rollback(n)
            self.consumed -= n

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (it may end here)."""
        return self.matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Complete, and nothing but an end token may follow."""
        return self.matcher.is_stopped()

    def check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"the grammar engine failed: {self.matcher.get_error()}")
