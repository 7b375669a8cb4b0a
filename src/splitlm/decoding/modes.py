"""The `--spec` modes, listed once: what each drafts from, what the edge must hand its drafter, and
how the drafter is built.

Everything else that knows the modes reads `SPEC_MODES`: `SpecConfig`'s check, the CLI's `--spec`
choices and help (`splitlm.cli.options.add_spec_options`), the edge's questions (does this mode
need the n-gram model of local text? the draft memory? the tokenizer's text view?) and the table in docs/speculative.md
(`tests/decoding/test_modes.py` compares them). A new drafter is its own module and one row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from splitlm.decoding.auto import AutoDrafter, DraftMemory
from splitlm.decoding.budget import COST_MODELS
from splitlm.decoding.copy import CopyDrafter, TextTokenizer
from splitlm.decoding.corpus import CorpusDrafter, NgramModel
from splitlm.decoding.drafters import CombinedDrafter, Drafter, LookaheadDrafter, NgramDrafter
from splitlm.decoding.recycle import RecycledDrafter
from splitlm.decoding.suffix import SuffixDrafter


@dataclass
class SpecConfig:
    """How a request speculates: its mode (a name in `SPEC_MODES`) and the knobs its drafter and
    step budget read."""

    mode: str = "none"
    max_nodes: int | None = None  # fixed tree size (root included); None = chosen per step from the link
    window: int = 5  # lookahead: columns W
    ngram: int = 4  # lookahead: N (window levels = N - 1)
    max_depth: int = 8  # n-gram drafter: longest continuation
    pipeline: bool = False  # send the next step while one is in flight (`splitlm.decoding.pipeline`)
    cost: str = "measured"  # the step budget's cost model: measured, or zero (a cloud whose extra tokens cost nothing)
    warmup: bool = True  # retrieval and the recycled table's seed read the warm-up answers too (False: pydoc only)
    head: bool = True  # draft with the trained head where there is one (False: retrieval and recycling only)
    memory: str = ""  # the drafting memory's name: two names never share past outputs (the bench's modes)

    def __post_init__(self):
        spec_mode(self.mode)  # an unknown name fails here
        if self.cost not in COST_MODELS:
            raise ValueError(f"unknown cost model {self.cost!r} (choose from {', '.join(COST_MODELS)})")

    @property
    def budget_nodes(self) -> int:
        """The most tree nodes a step may send: 128 where extra tokens cost nothing, else 64."""
        return 128 if self.cost == "zero" else 64


@dataclass(frozen=True)
class DraftSources:
    """What a mode's drafter is built from: the request's settings and what the edge keeps for it."""

    spec: SpecConfig
    corpus: NgramModel | None  # the n-gram model of local text (modes that need it; None without a tokenizer)
    memory: DraftMemory  # the state the edge's drafters keep across requests (a fresh one where none is kept)
    text: TextTokenizer | None = None  # the tokenizer's text view (`auto` copies prompt text with it; None: no copies)


@dataclass(frozen=True)
class SpecMode:
    """One `--spec` mode."""

    name: str
    help: str  # what it drafts from, in a few words (the CLI's help)
    build: Callable[[DraftSources], Drafter]
    needs_corpus: bool = False  # its drafter reads the n-gram model of local text (`Edge.corpus_model`)
    needs_memory: bool = False  # its drafter keeps its state in the edge's `DraftMemory` (`Edge.draft_memory`)
    needs_text: bool = False  # its drafter reads the tokenizer's text view (`EdgeGrammars.text_view`)
    adapts_window: bool = False  # its lookahead window is resized every step to what the link affords


def auto_window(s: DraftSources) -> Drafter:
    """The older combination: the context's n-grams, the local text's n-gram model (when there is
    one) and a lookahead window, merged."""
    drafters: list[Drafter] = [NgramDrafter(max_depth=s.spec.max_depth)]
    if s.corpus is not None:
        drafters.append(CorpusDrafter(s.corpus, mix_context=True))
    drafters.append(LookaheadDrafter(width=s.spec.window, ngram=s.spec.ngram))
    return CombinedDrafter(drafters)


def suffix(s: DraftSources) -> Drafter:
    return SuffixDrafter([s.memory.corpus, s.memory.past.index()], s.memory.suffix_calibration)


def head(s: DraftSources) -> Drafter:
    if s.memory.head is None:
        raise ValueError("speculative mode head needs a trained draft head (splitlm train-head)")
    return s.memory.head.drafter()


def auto(s: DraftSources) -> Drafter:
    """Retrieval, recycled and (when one is trained) head drafts merged, the head guided by the others'
    tree; then (given the tokenizer's text view) copies of the prompt's text under the merged tree's
    best nodes."""
    drafters = [suffix(s), RecycledDrafter(s.memory.recycle)]
    if s.memory.head is not None:
        drafters.append(s.memory.head.drafter())
    if s.text is not None:
        drafters.append(CopyDrafter(s.text, s.memory.copy_calibration))
    return AutoDrafter(drafters)


SPEC_MODES: dict[str, SpecMode] = {
    m.name: m
    for m in (
        SpecMode("none", "no drafting, one token per round trip", lambda s: Drafter()),
        SpecMode(
            "ngram", "earlier occurrences of the context's suffix", lambda s: NgramDrafter(max_depth=s.spec.max_depth)
        ),
        SpecMode(
            "lookahead",
            "a Jacobi window iterated inside each pass, its n-gram pool",
            lambda s: LookaheadDrafter(width=s.spec.window, ngram=s.spec.ngram),
        ),
        SpecMode(
            "recycle",
            "each token's top-k successors from its latest pass",
            lambda s: RecycledDrafter(s.memory.recycle),
            needs_memory=True,
        ),
        SpecMode(
            "suffix",
            "the longest earlier match in the request, the warm-up corpus and past outputs",
            suffix,
            needs_memory=True,
        ),
        SpecMode("head", "the draft head of `splitlm train-head`", head, needs_memory=True),
        SpecMode("auto", "suffix, recycle, head and prompt copies merged", auto, needs_memory=True, needs_text=True),
        SpecMode(
            "auto-window",
            "the older combination of ngram, local-text n-grams and a lookahead window",
            auto_window,
            needs_corpus=True,
            adapts_window=True,
        ),
    )
}


def spec_mode(name: str) -> SpecMode:
    """The mode called `name`; ValueError naming the modes if there is none."""
    if name not in SPEC_MODES:
        raise ValueError(f"unknown speculative mode {name!r} (choose from {', '.join(SPEC_MODES)})")
    return SPEC_MODES[name]


def make_drafter(
    cfg: SpecConfig,
    corpus: NgramModel | None = None,
    memory: DraftMemory | None = None,
    text: TextTokenizer | None = None,
) -> Drafter:
    """The drafter of `cfg.mode`. `corpus`: the local text's n-gram model (`auto-window` drafts from it
    when given); `memory`: the state `recycle`, `suffix`, `head` and `auto` keep across requests (a
    fresh one if None); `text`: the tokenizer's text view (`auto` copies the prompt's text with it).
    The drafter's `adapts_window` is the mode's."""
    mode = spec_mode(cfg.mode)
    drafter = mode.build(DraftSources(cfg, corpus, memory or DraftMemory(), text))
    drafter.adapts_window = mode.adapts_window
    return drafter
