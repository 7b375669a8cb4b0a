"""What an edge's drafters and step budgets keep across its requests (`DraftState`): the local text
(tokenized once), its n-gram model, its suffix index, one `DraftMemory` per speculative
configuration and the pools of step budgets. Built on first use; never sent."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from splitlm import SplitLMError
from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.corpus import NgramModel, default_corpus_documents
from splitlm.decoding.head import HeadRunner, load_head
from splitlm.decoding.layer_drafter import LayerHeadRunner
from splitlm.decoding.layer_head import LayerHead
from splitlm.decoding.modes import SpecConfig, make_drafter, spec_mode
from splitlm.decoding.suffix import SuffixIndex
from splitlm.decoding.warmup import find_warmup, read_warmup
from splitlm.edge.connections import Pool
from splitlm.edge.onnx_runtime import OnnxEdge
from splitlm.edge.text import TextCodec
from splitlm.model.shards import EdgeModel

if TYPE_CHECKING:
    from splitlm.decoding.drafters import Drafter
    from splitlm.edge.grammars import EdgeGrammars


def memory_key(spec: SpecConfig) -> tuple:
    """The fields that keep two speculative configurations' drafting memories apart (their budgets too)."""
    return (spec.mode, spec.max_nodes, spec.pipeline, spec.cost, spec.warmup, spec.head, spec.memory)


class DraftState:
    """The drafting state of the edge whose shard is in `edge_dir`, its `model` on `device`. `text`: its
    tokenizer (none: no local text), whose lock also guards the tables here; `with_head`: whether the
    edge's back end gives the final hidden state that a trained draft head reads."""

    def __init__(
        self, edge_dir: Path, model: EdgeModel | OnnxEdge, device: torch.device, text: TextCodec, with_head: bool
    ):
        self.edge_dir, self.model, self.device, self.with_head = edge_dir, model, device, with_head
        self.tokenizer = text.tokenizer
        self._lock = text.lock  # the pools' table, the corpus model, the tokenizer
        self._corpus: NgramModel | None = None
        self._corpus_ids: dict[bool, list[list[int]]] = {}  # with the warm-up answers (True) or without
        self._suffix_index: dict[bool, SuffixIndex] = {}
        self._memories: dict[tuple, DraftMemory] = {}
        self._budgets: dict[tuple, Pool[StepBudget]] = {}

    def corpus_documents(self, warmup: bool = True) -> list[str]:
        """Local text for the `auto` drafter: Python's pydoc topics and, when there is one for this
        model (and `warmup`), a warm-up file of its own answers (`splitlm warmup`; bundled for the default model)."""
        docs = default_corpus_documents()
        found = find_warmup(self.edge_dir, self.model.manifest.model_hash) if warmup else None
        return docs + (read_warmup(found) if found is not None else [])

    def corpus_ids(self, warmup: bool = True) -> list[list[int]]:
        """The local text's documents as token ids (tokenized once; none without a tokenizer)."""
        with self._lock:
            if warmup not in self._corpus_ids:
                self._corpus_ids[warmup] = (
                    []
                    if self.tokenizer is None
                    else self.tokenizer(self.corpus_documents(warmup), add_special_tokens=False).input_ids
                )
            return self._corpus_ids[warmup]

    def corpus_model(self) -> NgramModel | None:
        """The n-gram model of local text the `auto-window` drafter uses (built once, a few s; needs the tokenizer)."""
        if self.tokenizer is None:
            return None
        docs = self.corpus_ids()
        with self._lock:
            if self._corpus is None:
                self._corpus = NgramModel([tok for doc in docs for tok in doc])
            return self._corpus

    def draft_memory(self, spec: SpecConfig) -> DraftMemory:
        """What the `recycle`, `suffix`, `head` and `auto` drafters keep across this edge's requests, one per
        speculative configuration: built on first use (the corpus's suffix index and the recycled table's
        seed: a few s), the trained head loaded if the shard has one. Never sent."""
        docs = self.corpus_ids(spec.warmup)
        with self._lock:
            if spec.warmup not in self._suffix_index:
                self._suffix_index[spec.warmup] = SuffixIndex(docs)
            # two configurations never share past outputs (a bench's modes would otherwise retrieve another
            # mode's answer to the same prompt); `memory` keeps apart what the other fields do not
            key = memory_key(spec)
            if key not in self._memories:
                head = self.head_runner() if spec.head else None
                self._memories[key] = DraftMemory.seeded(self._suffix_index[spec.warmup], head)
            return self._memories[key]

    def head_runner(self) -> HeadRunner | LayerHeadRunner | None:
        """The shard's trained draft head on the edge's device, if it has one and the edge the final
        hidden state it reads (split-head and ONNX edges have none)."""
        manifest = self.model.manifest
        head = load_head(self.edge_dir, manifest.model_hash, manifest.cloud_layers) if self.with_head else None
        if head is None:
            return None
        runner = LayerHeadRunner if isinstance(head, LayerHead) else HeadRunner
        return runner(
            head.to(self.device), self.model.embed_tokens.weight, self.model.head_weight, self.model.cfg.embed_scale
        )

    def budgets(self, spec: SpecConfig, constrained: bool = False) -> Pool[StepBudget]:
        """The step budgets of one speculative configuration: what a budget learns (link, compute cost,
        drafters' calibration) carries over between requests; requests running at once each take their own.
        Constrained requests keep budgets of their own: the drafts a grammar lets through are accepted
        more often at the same score, and their steps carry the masks' cost. Two drafting memories
        (`spec.memory`: a bench's modes) never share a budget either."""
        with self._lock:
            key = (*memory_key(spec), spec.window, constrained)
            if key not in self._budgets:
                self._budgets[key] = Pool(
                    lambda: StepBudget(max_nodes=spec.budget_nodes, fixed_nodes=spec.max_nodes, cost=spec.cost)
                )
            return self._budgets[key]

    def drafter(self, spec: SpecConfig, grammars: EdgeGrammars) -> tuple[Drafter, DraftMemory | None]:
        """The drafter of a request, and the memory it keeps across requests (None if it keeps none)."""
        mode = spec_mode(spec.mode)
        corpus = self.corpus_model() if mode.needs_corpus else None
        memory = self.draft_memory(spec) if mode.needs_memory else None
        text = grammars.text_view() if mode.needs_text else None
        try:
            return make_drafter(spec, corpus, memory, text), memory
        except ValueError as e:
            raise SplitLMError(str(e)) from None
