"""Retrieval drafts: the longest earlier match of the context's suffix, in three places.

- the request's own text (prompt and output so far): a suffix automaton built online, one token
  per step; each state remembers where its string last ended, so the latest match is continued;
- the warm-up corpus (the model's own answers, `splitlm warmup`, and Python's pydoc topics), and
- the edge's past outputs (a bounded store kept on the edge, never sent):
  suffix arrays over the reversed text, so that extending the match one token further back narrows
  a range of sorted suffixes; every suffix in the final range is an occurrence, and the
  continuations after them are merged into a tree scored by frequency.

The longer the match, the further a continuation is drafted (`depth_for`), and each node's score
is its drafter's observed acceptance for its match length, source and frequency
(`KeyedCalibration`)."""

from __future__ import annotations

import threading
from collections import Counter, deque

import numpy as np

from splitlm.decoding.drafters import CalibratedDrafter, KeyedCalibration
from splitlm.decoding.tree import TokenTree

SEP = -1  # between documents: matches nothing, ends every continuation
SORT_DEPTH = 64  # suffixes are sorted by their first 64 tokens: longer matches count as 64


def depth_for(match_len: int, max_depth: int = 16) -> int:
    """How far to draft after a match of `match_len` tokens."""
    return max(2, min(max_depth, 2 * match_len))


class SuffixIndex:
    """A suffix array over the reversed token text: `sa` [N] sorts the suffixes of `rev` [N]."""

    def __init__(self, docs: list[list[int]]):
        parts = []
        for d in docs:
            parts += [np.asarray(d, dtype=np.int32), np.array([SEP], dtype=np.int32)]
        text = np.concatenate(parts) if parts else np.array([SEP], dtype=np.int32)  # [N]
        self.text = text
        self.rev = np.concatenate([text[::-1], np.full(SORT_DEPTH + 1, -2, dtype=np.int32)])  # padded past the end
        self.sa = self._suffix_array(text[::-1].astype(np.int64))
        self.first = self.rev[self.sa]  # [N] each sorted suffix's first token: depth 0 needs no gather

    @staticmethod
    def _suffix_array(r: np.ndarray) -> np.ndarray:
        """Prefix doubling up to SORT_DEPTH tokens (ranks: -1 past the end, 0 a separator)."""
        n = len(r)
        rank = r + 2 - 1  # SEP (-1) -> 0, tokens -> 1..V
        sa = np.argsort(rank, kind="stable")
        k = 1
        while k < SORT_DEPTH:
            second = np.full(n, -1, dtype=np.int64)
            second[: n - k] = rank[k:]
            sa = np.lexsort((second, rank))
            r1, r2 = rank[sa], second[sa]
            new = np.empty(n, dtype=np.int64)
            new[sa] = np.r_[0, np.cumsum((r1[1:] != r1[:-1]) | (r2[1:] != r2[:-1]))]
            rank = new
            if rank.max() == n - 1:
                break
            k *= 2
        return sa.astype(np.int32)

    def __len__(self) -> int:
        return len(self.text)

    def match(self, context: list[int]) -> list[tuple[int, int, int]]:
        """(length m, lo, hi) for each m = 1.. up to the longest suffix of `context` found:
        sa[lo:hi] are its occurrences."""
        lo, hi, out = 0, len(self.sa), []
        for j, tok in enumerate(reversed(context[-SORT_DEPTH:])):
            vals = self.first if j == 0 else self.rev[self.sa[lo:hi].astype(np.int64) + j]
            a, b = np.searchsorted(vals, tok, "left"), np.searchsorted(vals, tok, "right")
            if a == b:
                break
            lo, hi = lo + int(a), lo + int(b)
            out.append((j + 1, lo, hi))
        return out

    def continuations(self, lo: int, hi: int, depth: int, limit: int) -> list[list[int]]:
        """The tokens after up to `limit` occurrences sa[lo:hi] (evenly spread), cut at a separator."""
        n = len(self.text)
        picks = self.sa[lo:hi] if hi - lo <= limit else self.sa[np.linspace(lo, hi - 1, limit).astype(np.int64)]
        out = []
        for p in picks.tolist():
            start = n - p  # the forward index just after the match's last token
            cont = self.text[start : start + depth].tolist()
            if SEP in cont:
                cont = cont[: cont.index(SEP)]
            if cont:
                out.append(cont)
        return out


class ContextAutomaton:
    """A suffix automaton of a growing token text, each state with its latest end position."""

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.end = [-1], [0], [-1]
        self.last, self.text = 0, []

    def add(self, tok: int) -> None:
        i = len(self.text)
        self.text.append(tok)
        cur = len(self.length)
        self.next.append({})
        self.length.append(self.length[self.last] + 1)
        self.link.append(0)
        self.end.append(i)
        p = self.last
        while p != -1 and tok not in self.next[p]:
            self.next[p][tok] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][tok]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = len(self.length)
                self.next.append(dict(self.next[q]))
                self.length.append(self.length[p] + 1)
                self.link.append(self.link[q])
                self.end.append(self.end[q])
                while p != -1 and self.next[p].get(tok) == q:
                    self.next[p][tok] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur
        s, hops = self.link[cur], 0
        while s > 0 and hops < 256:  # every suffix of the text now also ends at i
            self.end[s] = i
            s, hops = self.link[s], hops + 1

    def match(self, context: list[int], window: int = 64) -> tuple[int, int]:
        """(state, length) of the longest suffix of `context` (its last `window` tokens) in the text."""
        state, length = 0, 0
        for tok in context[-window:]:
            while state and tok not in self.next[state]:
                state = self.link[state]
                length = self.length[state]
            if tok in self.next[state]:
                state, length = self.next[state][tok], length + 1
        return state, length


class PastOutputs:
    """The edge's own recent outputs (at most `max_tokens`, oldest dropped first) and their suffix index,
    rebuilt when asked for after new outputs arrived."""

    def __init__(self, max_tokens: int = 65536):
        self.max_tokens, self.docs, self.total = max_tokens, deque(), 0
        self._index: SuffixIndex | None = None
        self._lock = threading.Lock()

    def add(self, ids: list[int]) -> None:
        with self._lock:
            self.docs.append(list(ids))
            self.total += len(ids)
            while self.total > self.max_tokens and len(self.docs) > 1:
                self.total -= len(self.docs.popleft())
            self._index = None

    def index(self) -> SuffixIndex | None:
        with self._lock:
            if self._index is None and self.docs:
                self._index = SuffixIndex(list(self.docs))
            return self._index


class SuffixDrafter(CalibratedDrafter):
    """Retrieval drafts from the context automaton and suffix indexes (corpus, past outputs)."""

    name = "suffix"

    def __init__(
        self,
        indexes: list[SuffixIndex],
        calibration: KeyedCalibration | None = None,
        max_depth: int = 16,
        max_matches: int = 24,
    ):
        self.indexes = [ix for ix in indexes if ix is not None]
        self.calibration = calibration or KeyedCalibration()
        self.max_depth, self.max_matches = max_depth, max_matches

    def reset(self, context: list[int]) -> None:
        self.context = []
        self.sam = ContextAutomaton()
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:  # the automaton holds the context but its last token (matches must end earlier)
            if self.context:
                self.sam.add(self.context[-1])
            self.context.append(tok)

    def _add(self, tree: TokenTree, conts: list[list[int]], source: int, match_len: int) -> None:
        counts: Counter = Counter()
        for c in conts:
            for d in range(1, len(c) + 1):
                counts[tuple(c[:d])] += 1
        total = len(conts)
        m = min(match_len, 12)
        for c in conts:
            node = 0
            for d in range(1, len(c) + 1):
                share = counts[tuple(c[:d])] / counts[tuple(c[: d - 1])] if d > 1 else counts[tuple(c[:1])] / total
                key = (source, m, min(d, 6), min(4, int(share * 4)))
                prior = 0.9 * share * match_len / (match_len + 2.0)
                node = tree.add(node, c[d - 1], self.calibration.p(key, prior), key)

    def propose(self) -> TokenTree:
        ctx = self.context
        tree = TokenTree.root_only(ctx[-1])
        state, length = self.sam.match(ctx)
        seen, hops = set(), 0
        while state > 0 and hops < 4:  # the latest match, then the latest of shorter matches
            e = self.sam.end[state]
            cont = ctx[e + 1 : e + 1 + depth_for(length, self.max_depth)]
            if cont and tuple(cont[:4]) not in seen:
                seen.add(tuple(cont[:4]))
                self._add(tree, [cont], 0, length)
            state = self.sam.link[state]
            length, hops = self.sam.length[state], hops + 1
        for source, ix in enumerate(self.indexes, start=1):
            ranges = ix.match(ctx)
            if not ranges:
                continue
            m, lo, hi = ranges[-1]
            conts = ix.continuations(lo, hi, depth_for(m, self.max_depth), self.max_matches)
            if hi - lo < 3 and len(ranges) > 1:  # few long matches: the next shorter one votes too
                m2, lo2, hi2 = ranges[-2]
                if m2 >= 2:
                    self._add(
                        tree, ix.continuations(lo2, hi2, depth_for(m2, self.max_depth), self.max_matches), source, m2
                    )
            self._add(tree, conts, source, m)
        self.last = tree
        return tree
