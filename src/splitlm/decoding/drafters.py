"""Drafters propose candidate continuations as a token tree; they learn from the accepted text.

    drafter.reset(context)           # prompt + root (the last generated token)
    tree = drafter.propose()         # TokenTree rooted at context[-1]
    drafter.extend(new_tokens)       # tokens appended to the context after verification

The lookahead drafter also runs a Jacobi window inside the same forward pass (see `Window`).

What a drafter can do beyond that it declares as attributes of `Drafter` (`extras`, `guided`,
`lookahead`, `window_gain`, `adapts_window`); the decoding loops read them and never ask a
drafter's type.
"""

from __future__ import annotations

import random
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import torch

from splitlm.decoding.step import StepResult
from splitlm.decoding.tree import TokenTree


class Drafter:
    """Drafts nothing (every tree is its root alone); the base of every drafter, and its capabilities."""

    name = "none"
    extras = 0  # > 0: verification passes should return each row's top-`extras` ids and hidden state
    features = False  # verification passes (and the prefill's last rows) return the rows' three features
    guided = False  # `propose(guide=tree)` takes the tree the drafters before it proposed (`auto` merges)
    lookahead: LookaheadDrafter | None = None  # the Jacobi window riding along each pass, if it runs one
    window_gain = 0.0  # tokens per step that only the lookahead window's pool proposed (an average)
    adapts_window = False  # the lookahead window is resized every step to what the link affords
    drafts_after = False  # `propose_after` drafts after paths the step will carry (a grammar's forced chains)
    continues_after = False  # `propose_after(..., guide=tree)` continues what the others drafted after them

    def reset(self, context: list[int]) -> None:
        self.context = list(context)

    def extend(self, tokens: list[int]) -> None:
        self.context.extend(tokens)

    def propose(self) -> TokenTree:
        return TokenTree.root_only(self.context[-1])

    def propose_after(self, paths: list[list[int]], reaches: list[float], guide: TokenTree | None = None) -> TokenTree:
        """A tree holding `paths` (after the root; each reached with the chance in `reaches`) and drafts
        after each (only where `drafts_after`; where `continues_after`, also after `guide`'s nodes)."""
        tree = TokenTree.root_only(self.context[-1])
        for path in paths:
            tree.add_path(path, [1.0] * len(path))
        return tree

    def accepted(self, drafted: list[int]) -> None:
        """The drafted tokens the target accepted in the last step (bonus token excluded)."""

    def verified(self, tree: TokenTree, path: list[int], new: list[int], step: StepResult) -> None:
        """After a verification pass of `tree` (the prefill: a root-only tree of the prompt's last token):
        the accepted `path`, the `new` tokens (accepted and the bonus), and the pass's `step` (with
        `extras`: `topk` [N, k] and `hidden` [N, D] per tree node)."""


def either(p: float, q: float) -> float:
    """The chance that at least one of two independent guesses is right (how `auto` merges drafters' votes)."""
    return 1.0 - (1.0 - p) * (1.0 - q)


class KeyedCalibration:
    """Observed acceptance of a drafter's nodes by key (what the drafter knows about a node: its rank,
    depth, match length...), shrunk towards the drafter's prior guess while a key is rarely seen."""

    def __init__(self, prior_weight: float = 3.0):
        self.counts: dict = {}
        self.prior_weight = prior_weight

    def p(self, key, prior: float) -> float:
        hits, total = self.counts.get(key, (0.0, 0.0))
        return (hits + self.prior_weight * prior) / (total + self.prior_weight)

    def learn(self, tree: TokenTree, new: list[int]) -> None:
        """Score the nodes of `tree` whose outcome the step decided. A greedy step accepted `new[:-1]`
        and chose `new[-1]` next, so every node whose parent path lies on `new` is decided (whether or
        not it was sent): accepted iff it continues along `new`."""
        for path, key in zip(tree.paths()[1:], tree.keys[1:], strict=True):
            d = len(path)
            if key is None or d > len(new) or path[:-1] != tuple(new[: d - 1]):
                continue
            hits, total = self.counts.get(key, (0.0, 0.0))
            self.counts[key] = (hits + (path[-1] == new[d - 1]), total + 1)


class CalibratedDrafter(Drafter):
    """A drafter that scores its nodes by its own `calibration` (keys on the nodes) and, after each pass,
    learns from the tree it proposed last (`last`, set by `propose`)."""

    calibration: KeyedCalibration
    last: TokenTree | None = None

    def verified(self, tree: TokenTree, path: list[int], new: list[int], step: StepResult) -> None:
        if self.last is not None:
            self.calibration.learn(self.last, new)
            self.last = None


class NgramDrafter(Drafter):
    """Prompt lookup as a tree: continuations of earlier occurrences of the context's suffix.

    Longer suffix matches are trusted more; all continuations found for the longest matching
    suffixes are merged into one tree whose node scores are the fraction of matches through them.
    """

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, max_depth: int = 8, max_matches: int = 12):
        self.max_n, self.min_n, self.max_depth, self.max_matches = max_n, min_n, max_depth, max_matches

    def reset(self, context: list[int]) -> None:
        self.context: list[int] = []
        self.index: dict[int, dict[tuple, list[int]]] = {
            n: defaultdict(list) for n in range(self.min_n, self.max_n + 1)
        }
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        ctx = self.context
        for tok in tokens:
            ctx.append(tok)
            end = len(ctx)  # the n-gram ctx[end-n:end] is followed by ctx[end] (once it exists)
            for n in self.index:
                if end >= n:
                    self.index[n][tuple(ctx[end - n : end])].append(end)

    def propose(self) -> TokenTree:
        ctx = self.context
        tree = TokenTree.root_only(ctx[-1])
        found = 0
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ctx) < n:
                continue
            ends = [e for e in self.index[n].get(tuple(ctx[-n:]), []) if e < len(ctx)]
            if not ends:
                continue
            ends = ends[-self.max_matches :]
            trust = n / (n + 1.0)
            paths = [ctx[e : e + self.max_depth] for e in ends]
            counts: dict[tuple, int] = defaultdict(int)
            for path in paths:
                for d in range(1, len(path) + 1):
                    counts[tuple(path[:d])] += 1
            for path in paths:
                tree.add_path(
                    path, [trust * counts[tuple(path[:d])] / (len(paths) + 1) for d in range(1, len(path) + 1)]
                )
            found += len(paths)
            if found >= self.max_matches:
                break
        return tree


@dataclass
class Window:
    """Lookahead tokens that ride along a verification pass: `levels` × `width`, and where to read outputs.

    Token (l, i) sits at root position + 1 + i + l and sees the root, level-0 tokens of columns
    0..i and its own column's tokens at levels 1..l: a causal history of consecutive positions.
    """

    levels: list[list[int]]  # [N-1][W]

    @property
    def width(self) -> int:
        return len(self.levels[0])

    def tokens(self) -> list[int]:
        return [tok for level in self.levels for tok in level]

    def rel_positions(self) -> list[int]:
        return [1 + i + lvl for lvl in range(len(self.levels)) for i in range(self.width)]

    def mask(self) -> torch.Tensor:
        """[L*W, L*W] visibility among window tokens (row-major by level)."""
        n_lv, w = len(self.levels), self.width
        m = torch.zeros(n_lv * w, n_lv * w, dtype=torch.bool)
        for lvl in range(n_lv):
            for i in range(w):
                row = lvl * w + i
                m[row, : i + 1] = True  # level 0, columns 0..i
                for up in range(1, lvl + 1):
                    m[row, up * w + i] = True
        return m

    def output_rows(self) -> list[int]:
        """Rows whose next-token predictions form the next level (the last level)."""
        last = (len(self.levels) - 1) * self.width
        return list(range(last, last + self.width))


class LookaheadDrafter(Drafter):
    """Lookahead decoding: a Jacobi window of W columns × (N-1) levels iterated in the verification
    pass; each column's trajectory yields an N-gram for a pool that proposes candidates for the root."""

    name = "lookahead"

    def __init__(self, width: int = 5, ngram: int = 4, max_candidates: int = 8, pool_per_key: int = 16, seed: int = 0):
        if ngram < 2 or width < 0:
            raise ValueError("lookahead needs ngram >= 2 and width >= 0")
        self.width, self.n, self.max_candidates, self.pool_per_key = width, ngram, max_candidates, pool_per_key
        self.seed = seed
        self.lookahead = self

    def reset(self, context: list[int]) -> None:
        self.context = list(context)
        self.pool: dict[int, OrderedDict[tuple, int]] = defaultdict(OrderedDict)
        rng = random.Random(self.seed)
        self.levels = [[rng.choice(self.context) for _ in range(self.width)] for _ in range(self.n - 1)]

    def add_ngram(self, gram: list[int]) -> None:
        entries = self.pool[gram[0]]
        key = tuple(gram[1:])
        entries[key] = entries.pop(key, 0) + 1  # most recent last
        while len(entries) > self.pool_per_key:
            entries.popitem(last=False)

    def window(self) -> Window | None:
        return Window(self.levels) if self.width > 0 else None

    def set_width(self, width: int) -> None:
        """Resize the window (columns dropped from, or random context tokens added at, the right)."""
        if width == self.width:
            return
        rng = random.Random(self.seed + len(self.context))
        self.levels = [
            level[:width] + [rng.choice(self.context) for _ in range(width - len(level))] for level in self.levels
        ]
        self.width = width

    def observe(self, outputs: list[int]) -> None:
        """Next-token predictions at the last level's rows -> a new level and N-grams for the pool."""
        for i, out in enumerate(outputs):
            self.add_ngram([level[i] for level in self.levels] + [out])
        self.levels = self.levels[1:] + [list(outputs)]

    def propose(self) -> TokenTree:
        root = self.context[-1]
        tree = TokenTree.root_only(root)
        entries = list(self.pool.get(root, {}).items())[-self.max_candidates :]
        total = sum(c for _, c in entries) + 1
        for cont, count in reversed(entries):
            s = 0.5 * count / total
            tree.add_path(list(cont), [s * 0.8**d for d in range(len(cont))])
        return tree


class DrafterGroup(Drafter):
    """Drafters that see the same context: `reset` and `extend` reach every one of them."""

    drafters: list[Drafter]

    def reset(self, context: list[int]) -> None:
        self.context = list(context)
        for d in self.drafters:
            d.reset(context)

    def extend(self, tokens: list[int]) -> None:
        self.context.extend(tokens)
        for d in self.drafters:
            d.extend(tokens)


class CombinedDrafter(DrafterGroup):
    """Several drafters' trees merged into one deduplicated tree (plus any one lookahead window)."""

    def __init__(self, drafters: list[Drafter]):
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)
        self.lookahead = next((d.lookahead for d in drafters if d.lookahead is not None), None)

    def propose(self) -> TokenTree:
        merged = TokenTree.root_only(self.context[-1])
        self.window_only: set[tuple] = set()  # paths only the lookahead pool proposed
        for d in self.drafters:
            tree = d.propose()
            before = len(merged)
            where = merged.add_tree(tree)
            if d is self.lookahead:  # its nodes the drafters before it lacked
                self.window_only |= {p for p, node in zip(tree.paths(), where, strict=True) if node >= before}
        return merged

    def accepted(self, drafted: list[int]) -> None:
        # EMA of accepted tokens per step that only the lookahead window's pool proposed
        gain = sum(tuple(drafted[:i]) in self.window_only for i in range(1, len(drafted) + 1))
        self.window_gain = 0.8 * self.window_gain + 0.2 * gain
