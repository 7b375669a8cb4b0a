"""`auto`: retrieval, recycled, head and copy drafts merged into one tree per step.

Each drafter scores its nodes by its own calibrated acceptance (learned separately per drafter,
`KeyedCalibration`: the chance a node is accepted once its parent is). Merging gives a node that
several drafters propose the chance that any of them is right, as if they were independent,
1 − Π(1 − p): agreement is evidence (in our offline runs it beat keeping the best chance), and the
step budget's own calibration by score corrects what independence overstates. The budget then
keeps the nodes whose chance to be reached pays for their cost in the pass
(`splitlm.decoding.budget`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitlm.decoding.drafters import Drafter, DrafterGroup, KeyedCalibration, either
from splitlm.decoding.head import HeadRunner
from splitlm.decoding.layer_drafter import LayerHeadRunner
from splitlm.decoding.recycle import RecycleTable
from splitlm.decoding.step import StepResult
from splitlm.decoding.suffix import PastOutputs, SuffixIndex
from splitlm.decoding.tree import TokenTree


@dataclass
class DraftMemory:
    """What the edge's drafters keep across requests (one per speculative mode on an edge; never sent):
    the recycled successor table, the corpus's suffix index, the store of past outputs, the trained
    head, and the retrieval and copy drafters' calibrations."""

    recycle: RecycleTable = field(default_factory=RecycleTable)
    corpus: SuffixIndex | None = None
    past: PastOutputs = field(default_factory=PastOutputs)
    head: HeadRunner | LayerHeadRunner | None = None
    suffix_calibration: KeyedCalibration = field(default_factory=KeyedCalibration)
    copy_calibration: KeyedCalibration = field(default_factory=KeyedCalibration)

    @classmethod
    def seeded(cls, corpus: SuffixIndex, head: HeadRunner | LayerHeadRunner | None = None) -> DraftMemory:
        """A fresh memory over `corpus` (the warm-up corpus's suffix index), its recycled table seeded
        from the corpus's successor pairs."""
        memory = cls(corpus=corpus, head=head)
        memory.recycle.seed(corpus.text)
        return memory


class AutoDrafter(DrafterGroup):
    """Its drafters' trees merged into one, in order; a `guided` drafter (the head, last) sees the
    tree the ones before it proposed."""

    def __init__(self, drafters: list[Drafter]):
        self.drafters = drafters
        self.name = "auto(" + "+".join(d.name for d in drafters) + ")"
        self.extras = max((d.extras for d in drafters), default=0)
        self.features = any(d.features for d in drafters)
        self.drafts_after = any(d.drafts_after for d in drafters)

    def propose(self) -> TokenTree:
        merged = TokenTree.root_only(self.context[-1])
        for d in self.drafters:  # the head last: it expands where the others' merged tree is strong
            merged.add_tree(d.propose(guide=merged) if d.guided else d.propose(), combine=either)
        return merged

    def propose_after(self, paths: list[list[int]], reaches: list[float]) -> TokenTree:
        merged = TokenTree.root_only(self.context[-1])
        # those that continue the others' drafts (copies of the prompt after a guessed first token) last
        for d in sorted((d for d in self.drafters if d.drafts_after), key=lambda d: d.continues_after):
            merged.add_tree(d.propose_after(paths, reaches, guide=merged), combine=either)
        return merged

    def accepted(self, drafted: list[int]) -> None:
        for d in self.drafters:
            d.accepted(drafted)

    def verified(self, tree: TokenTree, path: list[int], new: list[int], step: StepResult) -> None:
        for d in self.drafters:
            d.verified(tree, path, new, step)
