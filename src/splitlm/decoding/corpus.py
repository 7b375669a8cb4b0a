"""A drafter from an n-gram language model of local text (default: Python's own documentation,
`pydoc_data.topics`, which every Python has). It guesses common phrasing and code idioms that
the context has not shown yet; the context's own n-grams are the `NgramDrafter`'s job."""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict

from splitlm.decoding.drafters import Drafter
from splitlm.decoding.tree import TokenTree


def default_corpus_documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


class NgramModel:
    """Counts of the next token after each 1..max_n token context, with longest-context backoff."""

    def __init__(self, ids: list[int], max_n: int = 3, min_count: int = 2):
        self.max_n, self.min_count = max_n, min_count
        self.tables: dict[int, dict[tuple, Counter]] = {n: defaultdict(Counter) for n in range(1, max_n + 1)}
        self.ids: list[int] = []
        self.extend(ids)

    def extend(self, ids: list[int]) -> None:
        for tok in ids:
            i = len(self.ids)
            for n in range(1, min(self.max_n, i) + 1):
                self.tables[n][tuple(self.ids[i - n : i])][tok] += 1
            self.ids.append(tok)

    def lookup(self, context: list[int]) -> tuple[int, Counter | None]:
        """(order, next-token counts) of the longest context with enough observations."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            counts = self.tables[n].get(tuple(context[-n:]))
            if counts is not None and sum(counts.values()) >= self.min_count:
                return n, counts
        return 0, None

    def next_tokens(self, context: list[int], k: int) -> list[tuple[int, float]]:
        """Up to k likely next tokens with their estimated probabilities."""
        _, counts = self.lookup(context)
        if counts is None:
            return []
        total = sum(counts.values())
        return [(tok, c / total) for tok, c in counts.most_common(k)]


class CorpusDrafter(Drafter):
    """Best-first tree from the n-gram model: expand the most probable paths first.

    With `mix_context`, the text so far (prompt and output) forms a second n-gram model that
    is learnt online and trusted more the more often its context was seen.
    """

    name = "corpus"

    def reset(self, context: list[int]) -> None:
        self.context = list(context)
        self.live = NgramModel(context, max_n=4, min_count=1) if self.mix_context else None

    def extend(self, tokens: list[int]) -> None:
        self.context.extend(tokens)
        if self.live is not None:
            self.live.extend(tokens)

    def next_tokens(self, ctx: list[int]) -> list[tuple[int, float]]:
        base = self.model.next_tokens(ctx, self.branch)
        if self.live is None:
            return base
        order, counts = self.live.lookup(ctx)
        if counts is None:
            return base
        total = sum(counts.values())
        trust = total / (total + 1.0) * (order / (order + 1.0))
        mixed: dict[int, float] = {tok: (1 - trust) * p for tok, p in base}
        for tok, c in counts.most_common(self.branch):
            mixed[tok] = mixed.get(tok, 0.0) + trust * c / total
        return sorted(mixed.items(), key=lambda kv: -kv[1])[: self.branch]

    def __init__(
        self,
        model: NgramModel,
        max_nodes: int = 24,
        branch: int = 3,
        min_p: float = 0.02,
        max_depth: int = 8,
        mix_context: bool = False,
    ):
        self.model, self.max_nodes, self.branch, self.min_p, self.max_depth = model, max_nodes, branch, min_p, max_depth
        self.mix_context = mix_context

    def propose(self) -> TokenTree:
        tree = TokenTree.root_only(self.context[-1])
        tail = self.context[-4:]
        frontier = [(-1.0, 0, tail)]  # (-path probability, node, tokens leading to it)
        while frontier and len(tree) < self.max_nodes:
            neg_p, node, ctx = heapq.heappop(frontier)
            if len(ctx) - len(tail) >= self.max_depth:
                continue
            for tok, p in self.next_tokens(ctx):
                score = -neg_p * p
                if score < self.min_p or len(tree) >= self.max_nodes:
                    break
                child = tree.add(node, tok, score)
                heapq.heappush(frontier, (-score, child, ctx + [tok]))
        return tree
