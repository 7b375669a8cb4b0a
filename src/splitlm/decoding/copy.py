"""Copies of the prompt's text where the output splits it into other tokens.

A JSON string value starts right after a quote, so its first word is written without the space it
has in the prompt: `"Maria` where the prompt says ` Maria`, `["pen` `icillin` where it says
` penicillin`. Token-level retrieval (`splitlm.decoding.suffix`) finds no match there, and the
value costs a round trip per token. This drafter matches *text*: the output's text since its last
quote (or since the answer began), found in the prompt's text at the start of a word, is continued with the
tokenizer's own
split of the prompt's text from there (the split the model writes, as a rule), provided that split
begins with the tokens the output already has. It drafts at the root and under the first few nodes
of the other drafters' tree (`guided`: the value's first token is theirs to guess). A number is also
found without its thousands separators (`48000` where the prompt says `48,000`), as JSON writes it.
"""

from __future__ import annotations

import re
from typing import Protocol

from splitlm.decoding.drafters import CalibratedDrafter, KeyedCalibration
from splitlm.decoding.tree import TokenTree


class TextTokenizer(Protocol):
    def tokenize_str(self, text: str) -> list[int]: ...

    def decode_str(self, tokens: list[int]) -> str: ...


MAX_PARTIAL = 64  # characters since the quote: a longer value is left to token-level retrieval
COPY_CHARS = 80  # prompt text tokenized per match
MAX_MATCHES = 3  # latest occurrences of the partial text continued
MAX_TRIES = 8  # occurrences at a word start split per call (a short partial text occurs often)
GUIDED_NODES = 6  # the guide's best nodes (by reach) the drafter also continues
GROUPED = re.compile(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?!\d|,\d)")  # 48,000 and 1,250,000
VALUE_START = " :,[{"  # JSON punctuation between a quote and a value that is not a string


class CopyDrafter(CalibratedDrafter):
    """Drafts the prompt's text after the output's open string, split the way the tokenizer splits it."""

    name = "copy"
    guided = True
    drafts_after = True
    continues_after = True

    def __init__(self, tokenizer: TextTokenizer, calibration: KeyedCalibration | None = None, depth: int = 12):
        self.tok, self.depth = tokenizer, depth
        self.calibration = calibration or KeyedCalibration()
        self.pieces: dict[int, str] = {}

    def piece(self, token: int) -> str:
        if token not in self.pieces:
            self.pieces[token] = self.tok.decode_str([token])
        return self.pieces[token]

    def reset(self, context: list[int]) -> None:
        """`context`: the prompt and the first generated token."""
        self.context = list(context)
        self.prompt_len = len(context) - 1
        self.prompt_text = self.tok.decode_str(self.context[: self.prompt_len])
        # JSON writes a number without its thousands separators: `1450` where the prompt says `1,450`
        plain = GROUPED.sub(lambda m: m.group(0).replace(",", ""), self.prompt_text)
        self.texts = [self.prompt_text] + ([plain] if plain != self.prompt_text else [])

    def continuations(self, tokens: list[int]) -> list[list[int]]:
        """Continuations of output `tokens` (the last ones suffice) copied from the prompt's text."""
        partial, since = "", 0  # the text since the last quote (or the answer's start); whole tokens in it
        for tok in reversed(tokens):
            piece = self.piece(tok)
            if '"' in piece:
                partial = piece[piece.rindex('"') + 1 :] + partial  # a token may carry text after its quote
                break
            partial, since = piece + partial, since + 1
            if len(partial) > MAX_PARTIAL:
                return []
        probe = partial.lstrip(VALUE_START)  # `: 14` after a key: the number is what the prompt may hold
        if not probe.strip():
            return []
        have = tokens[len(tokens) - since :] if probe == partial else None
        out, seen = [], set()
        for text in self.texts:
            end, tries = len(text), 0
            while len(out) < MAX_MATCHES and tries < MAX_TRIES and (c := text.rfind(probe, 0, end)) >= 0:
                end = c + len(probe) - 1
                if c > 0 and text[c - 1].isalnum():
                    continue  # not the start of a word
                tries += 1
                cont = self.copy(text, c, probe, have)
                if cont and tuple(cont) not in seen:
                    seen.add(tuple(cont))
                    out.append(cont)
        return out

    def copy(self, prompt_text: str, c: int, probe: str, have: list[int] | None) -> list[int]:
        """The tokens after `probe`, found at character `c` of the prompt's text: the tokenizer's split of
        the text from `c` where it begins with the output's tokens `have`, else its split of the text
        after the probe (the model, having split the word its own way, as a rule goes on as the
        tokenizer would from there)."""
        stop = c + len(probe) + COPY_CHARS
        text = prompt_text[c:stop]
        if stop < len(prompt_text) and " " in text[len(probe) :]:
            text = text[: text.rindex(" ")]  # no word cut in two at the end
        if have is not None:
            ids = self.tok.tokenize_str(text)
            if ids[: len(have)] == have:
                return ids[len(have) : len(have) + self.depth]
        return self.tok.tokenize_str(text[len(probe) :])[: self.depth]

    def _add(self, tree: TokenTree, node: int, conts: list[list[int]]) -> None:
        for cont in conts:
            at = node
            for d, tok in enumerate(cont, start=1):
                key = ("copy", min(d, 6), min(len(conts), 2))
                at = tree.add(at, tok, self.calibration.p(key, 0.75 / len(conts)), key)

    def propose(self, guide: TokenTree | None = None) -> TokenTree:
        output = self.context[self.prompt_len :]
        tree = TokenTree.root_only(self.context[-1])
        self._add(tree, 0, self.continuations(output))
        if guide is not None:
            self.follow(tree, guide, output)
        self.last = tree
        return tree

    def propose_after(self, paths: list[list[int]], reaches: list[float], guide: TokenTree | None = None) -> TokenTree:
        """Copies after `paths` and after the best nodes `guide` drafted beyond them: where a forced
        chain opens a value, the head guesses its first token and the prompt may hold the rest."""
        output = self.context[self.prompt_len :]
        tree = TokenTree.root_only(self.context[-1])
        for path in paths:
            node = tree.add_path(path, [1.0] * len(path))
            self._add(tree, node, self.continuations(output + path))
        if guide is not None:
            on_paths = {0}
            for path in paths:
                node: int | None = 0
                for tok in path:
                    node = guide.child(node, tok) if node is not None else None
                    on_paths.add(node)
            self.follow(tree, guide, output, skip=on_paths)
        return tree

    def follow(self, tree: TokenTree, guide: TokenTree, output: list[int], skip: set | None = None) -> None:
        """Copies under the `GUIDED_NODES` nodes of `guide` likeliest to be reached (but those in `skip`)."""
        reach = [1.0] * len(guide)
        for i in range(1, len(guide)):
            reach[i] = reach[guide.parents[i]] * guide.scores[i]
        paths = guide.paths()
        nodes = [i for i in range(1, len(guide)) if skip is None or i not in skip]
        for i in sorted(nodes, key=lambda i: -reach[i])[:GUIDED_NODES]:
            conts = self.continuations(output + list(paths[i]))
            if conts:
                node = 0
                for tok in paths[i]:
                    node = tree.add(node, tok, 0.0)  # the guide's own node: its score stands (merged by `either`)
                self._add(tree, node, conts)
