"""Constrained decoding on the edge (`docs/structured-outputs.md`): the grammar engine's view of the
edge's tokenizer (made once) and the compiled grammars (kept, a few dozen); a constrained request is
decoded by the one loop (`splitlm.decoding.loop`) with a grammar's shape. The grammar never leaves
the edge: the cloud sees the steps' tokens as it sees any others."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from splitlm.decoding.grammar import (
    Grammar,
    GrammarError,
    GrammarSpec,
    GrammarState,
    GrammarTokenizer,
    compile_grammar,
)

if TYPE_CHECKING:
    from splitlm.decoding.copy import TextTokenizer
    from splitlm.edge.text import TextCodec

log = logging.getLogger(__name__)

KEPT_GRAMMARS = 64


class EdgeGrammars:
    """Compiles a request's `GrammarSpec` for the edge's tokenizer and hands out per-request states."""

    def __init__(self, text: TextCodec, vocab_size: int, eos_ids: list[int]):
        self.text, self.vocab_size, self.eos_ids = text, vocab_size, list(eos_ids)
        self._tokenizer: GrammarTokenizer | None = None
        self._unreadable = False  # the engine could not read the tokenizer (said once)
        self._compiled: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self) -> GrammarTokenizer:
        """The grammar engine's view of the tokenizer (built on first use, ~0.3 s for 49k tokens)."""
        with self._lock:
            if self._tokenizer is None:
                if self.text.tokenizer is None:
                    raise GrammarError(f"{self.text.edge_dir} has no tokenizer: constrained decoding needs one")
                with self.text.lock:
                    self._tokenizer = GrammarTokenizer.from_hf(self.text.tokenizer, self.vocab_size, self.eos_ids)
            return self._tokenizer

    def text_view(self) -> TextTokenizer | None:
        """The tokenizer's text view, for `auto`'s copies of prompt text (None: the edge has no tokenizer,
        or one the engine cannot read: `auto` then drafts without copies)."""
        if self.text.tokenizer is None or self._unreadable:
            return None
        try:
            return self.tokenizer().ll
        except GrammarError as e:
            log.warning("auto drafts without copies of prompt text: %s", e)
            self._unreadable = True
            return None

    def compile(self, spec: GrammarSpec) -> Grammar:
        """`spec` compiled (or taken from the ones kept); GrammarError if the engine cannot."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        grammar = compile_grammar(spec, self.tokenizer())
        with self._lock:
            self._compiled[spec] = grammar
            while len(self._compiled) > KEPT_GRAMMARS:
                self._compiled.popitem(last=False)
        return grammar

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A fresh state of `spec`'s grammar for one request."""
        return self.compile(spec).start()
