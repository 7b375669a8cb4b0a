"""Language-adaptive vocabulary subsets: which token ids the edge lets the model emit.

    all    every id
    en     tokens made only of Latin-script text, digits, punctuation, whitespace and code
           symbols (the code points of `EN_RANGES`)
    zh     `en` plus Chinese: CJK ideographs, radicals, CJK punctuation, full-width forms (`ZH_RANGES`)
    FILE   an allow-list: token ids separated by whitespace or commas, `#` starts a comment

A token is judged by its bytes (byte-level BPE: the byte each symbol stands for; SentencePiece:
`▁` is a space, `<0xNN>` a byte). A token that splits a multi-byte character is allowed when its
bytes can be part of an allowed character's UTF-8 encoding (a leading run of continuation bytes
that ends some allowed character, a trailing partial sequence that begins one). Special tokens
(end of sequence, chat markers) are always allowed. In the split-head topology the cloud computes
partial logits only for the allowed ids; in tail-local the edge only masks its own logits.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from splitlm import SplitLMError
from splitlm.transport.frames import pack_vocab

# inclusive code point ranges
EN_RANGES = (
    (0x09, 0x0D),
    (0x20, 0x7E),  # ASCII whitespace, letters, digits, punctuation, code symbols
    (0xA0, 0x24F),  # Latin-1 Supplement, Latin Extended-A and -B (accented letters, ©, °, ×)
    (0x1E00, 0x1EFF),  # Latin Extended Additional
    (0x2000, 0x206F),  # General Punctuation (dashes, curly quotes, ellipsis)
    (0x20A0, 0x20CF),  # currency symbols (€)
    (0x2100, 0x214F),
    (0x2190, 0x22FF),  # letterlike symbols (™), arrows, mathematical operators
)
ZH_RANGES = EN_RANGES + (
    (0x2E80, 0x2FDF),  # CJK and Kangxi radicals
    (0x3000, 0x303F),  # CJK symbols and punctuation (、。「」)
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),  # CJK ideographs (Ext. A, unified, compatibility)
    (0xFE30, 0xFE4F),  # CJK compatibility forms
    (0xFF00, 0xFFEF),  # half-width and full-width forms (，！？：)
)
NAMED = {"en": EN_RANGES, "zh": ZH_RANGES}


@dataclass
class VocabSubset:
    """An allow-list of token ids; `allowed` [V] bool."""

    name: str
    allowed: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.allowed.sum())

    @property
    def everything(self) -> bool:
        return bool(self.allowed.all())

    @functools.cached_property
    def ids(self) -> torch.Tensor:
        """The allowed ids, ascending, [S] int64."""
        return self.allowed.nonzero().flatten()

    def packed(self) -> bytes:
        """The allow-list as packed bits (bit i = id i, most significant bit first, as numpy.packbits)."""
        return pack_vocab(self.allowed)

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits with every id outside the subset at −inf."""
        return logits if self.everything else logits.masked_fill(~self.allowed, -torch.inf)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins: printable Latin-1 bytes stand for themselves, the
    other bytes (control, space, ...) for 256, 257, ... in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer) -> list[bytes | None]:
    """Each id's bytes; None for ids the tokenizer does not know."""
    vocab = tokenizer.get_vocab()
    pieces: list[str | None] = [None] * (max(vocab.values()) + 1 if vocab else 0)
    for piece, i in vocab.items():
        pieces[i] = piece
    alphabet = _byte_level_alphabet()
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"
    out: list[bytes | None] = []
    for p in pieces:
        if p is None:
            out.append(None)
        elif byte_level and all(c in alphabet for c in p):
            out.append(bytes(alphabet[c] for c in p))
        elif m := BYTE_PIECE.fullmatch(p):
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append(p.replace("▁", " ").encode("utf-8"))
    return out


def _utf8(cp: int) -> bytes:
    return chr(cp).encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=4)
def _fragments(ranges: tuple) -> tuple[frozenset, ...]:
    """(code points, proper prefixes, proper suffixes, runs of continuation bytes) of the allowed
    characters' UTF-8 encodings."""
    cps = frozenset(cp for a, b in ranges for cp in range(a, b + 1) if not 0xD800 <= cp <= 0xDFFF)
    prefixes, suffixes, inner = set(), set(), set()
    for cp in cps:
        enc = _utf8(cp)
        for a in range(1, len(enc)):
            prefixes.add(enc[:a])
            suffixes.add(enc[a:])
            inner.update(enc[a:b] for b in range(a + 1, len(enc) + 1))
    return cps, frozenset(prefixes), frozenset(suffixes), frozenset(inner)


def _seq_len(lead: int) -> int:
    """Length of the UTF-8 sequence a byte starts (0: a continuation or invalid byte)."""
    return (
        1
        if lead < 0x80
        else 2
        if 0xC2 <= lead < 0xE0
        else 3
        if 0xE0 <= lead < 0xF0
        else 4
        if 0xF0 <= lead < 0xF5
        else 0
    )


def bytes_allowed(data: bytes, ranges: tuple) -> bool:
    """Whether a token's bytes can be (part of) text made of the characters in `ranges`."""
    cps, prefixes, suffixes, inner = _fragments(ranges)
    i = 0
    while i < len(data) and 0x80 <= data[i] < 0xC0:  # the end of a character begun in an earlier token
        i += 1
    if i and data[:i] not in (inner if i == len(data) else suffixes):
        return False
    while i < len(data):
        n = _seq_len(data[i])
        if n == 0:
            return False
        chunk = data[i : i + n]
        if len(chunk) < n:  # a character completed by a later token
            return chunk in prefixes
        try:
            ch = chunk.decode("utf-8")
        except UnicodeDecodeError:
            return False
        if ord(ch) not in cps:
            return False
        i += n
    return True


def subset_from_ranges(name: str, tokenizer, vocab_size: int, ranges: tuple, always: set[int]) -> VocabSubset:
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    for i, data in enumerate(token_bytes(tokenizer)[:vocab_size]):
        if data is not None and data and bytes_allowed(data, ranges):
            allowed[i] = True
    allowed[sorted(i for i in always if 0 <= i < vocab_size)] = True
    return VocabSubset(name, allowed)


def read_allow_list(path: Path, vocab_size: int, always: set[int]) -> VocabSubset:
    try:
        text = path.read_text()
    except OSError as e:
        raise SplitLMError(f"cannot read the vocabulary allow-list {path}: {e.strerror or e}") from None
    ids = []
    for n, line in enumerate(text.splitlines(), 1):
        for word in re.split(r"[\s,]+", line.split("#", 1)[0].strip()):
            if not word:
                continue
            if not re.fullmatch(r"\d+", word) or int(word) >= vocab_size:
                raise SplitLMError(f"{path}:{n}: {word!r} is not a token id in [0, {vocab_size})")
            ids.append(int(word))
    if not ids:
        raise SplitLMError(f"{path}: the allow-list holds no token id")
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    allowed[ids] = True
    allowed[sorted(i for i in always if 0 <= i < vocab_size)] = True
    return VocabSubset(path.name, allowed)


def special_ids(tokenizer, eos_ids: list[int]) -> set[int]:
    ids = set(eos_ids)
    if tokenizer is not None:
        ids |= set(tokenizer.all_special_ids)
    return ids


def resolve_vocab(spec: str | VocabSubset | None, tokenizer, vocab_size: int, eos_ids: list[int]) -> VocabSubset:
    """`all`, `en`, `zh` or an allow-list file, for a model with `vocab_size` ids."""
    if isinstance(spec, VocabSubset):
        if spec.allowed.shape != (vocab_size,):
            raise SplitLMError(f"the vocabulary subset covers {spec.allowed.numel()} ids, the model has {vocab_size}")
        return spec
    spec = spec or "all"
    if spec == "all":
        return VocabSubset("all", torch.ones(vocab_size, dtype=torch.bool))
    always = special_ids(tokenizer, eos_ids)
    if spec in NAMED:
        if tokenizer is None:
            raise SplitLMError(f"--vocab {spec} is derived from the tokenizer, and this edge shard has none")
        return subset_from_ranges(spec, tokenizer, vocab_size, NAMED[spec], always)
    path = Path(spec)
    if not path.is_file():
        raise SplitLMError(f"--vocab {spec!r}: not all, en, zh or an allow-list file")
    return read_allow_list(path, vocab_size, always)
