"""Grammar-aware token trees: a drafter's tree walked through the request's grammar before it is sent.

From the root (the grammar state after the last emitted token) every node's state gives the tokens
allowed after it (a packed mask row, which also goes with the step: verification picks the best
*allowed* token at each node):

- a drafted child the grammar rejects is pruned with its subtree (counted in `rejected`): it could
  never be accepted, and would cost the pass a row;
- where the state forces its next token (`GrammarState.forced`), the child holding it is kept (or
  added) as a *certain* node (key `FORCED`, score 1): it will be emitted whatever the model says,
  so the budget counts it with probability 1, and the chain goes on while the grammar keeps forcing
  (`max_forced` nodes per chain). Its own row is still computed: the token after it needs the
  model's logits at its position, and the cache needs its entry;
- where the state allows only a few tokens (at most `SMALL_CHOICE`: an enum's or a boolean's first
  token, a comma or a closing bracket), those the drafter did not propose are added as children
  with an equal share of the chance (key `CHOICE`: no drafter's), each followed by the
  chain its choice forces; at most `MAX_CHOICE_NODES` such nodes per tree, and two such choices in
  a row at most (and no node the drafter lacks past `MAX_WALK` nodes: each costs a mask). The budget
  weighs them like any node, so most are cut when they rarely pay.

After the walk, `add_value_ends` adds where a value may end: at the likeliest few nodes inside a JSON
string where a word ends and a drafted child begins another word or punctuation (a copy of the
prompt's text running on past the phrase the model takes), the string's closing tokens (`",` before
the next key), each followed by the chain it forces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from splitlm.decoding.grammar import (
    PUNCT_LED,
    SPACE_LED,
    GrammarState,
    GrammarTokenizer,
    allows,
    mask_words,
    unpack_masks,
)
from splitlm.decoding.tree import FORCED, TokenTree


@dataclass
class ConstrainedTree:
    """A tree every node of which the grammar allows, and each node's allowed next tokens."""

    tree: TokenTree
    rows: list[np.ndarray] = field(default_factory=list)  # [N] packed masks [W] int32: the tokens allowed after node i
    rejected: int = 0  # drafted nodes pruned (subtrees included)
    forced: int = 0  # forced nodes the drafter had not proposed
    choices: int = 0  # nodes added because their state allowed only a few tokens

    def allowed(self, nodes: list[int], vocab_size: int) -> torch.Tensor:
        """[len(nodes), V] bool: the tokens allowed after each of `nodes`."""
        return unpack_masks(np.stack([self.rows[i] for i in nodes]), vocab_size)


class Choice:
    """The key of a node the walk added as one of the few tokens a state allows (a small choice, a
    string's close): no drafter proposed it, calibrates it, or drafted after it."""

    def __repr__(self) -> str:
        return "CHOICE"


CHOICE = Choice()
SMALL_CHOICE = 4  # the most tokens a state may allow for all of them to join the tree
MAX_CHOICE_NODES = 24  # choice nodes added to one tree
MAX_CHOICES_IN_A_ROW = 2
MAX_WALK = 64  # no node the drafter lacks (forced or choice) is added past this tree size: each costs a mask


def small_choice(row: np.ndarray, most: int) -> list[int] | None:
    """The tokens packed mask `row` allows, when there are at most `most` (else None)."""
    if np.count_nonzero(row) > most:  # more words with a bit set than tokens asked for
        return None
    tokens = np.flatnonzero(np.unpackbits(np.ascontiguousarray(row, dtype="<i4").view(np.uint8), bitorder="little"))
    return tokens.tolist() if len(tokens) <= most else None


def subtree_size(children: dict[int, list[int]], node: int) -> int:
    return 1 + sum(subtree_size(children, c) for c in children.get(node, []))


class Walk:
    """One depth-first walk of a drafter's tree through the grammar (the state moves with the walk and
    ends where it began)."""

    def __init__(self, tree: TokenTree, state: GrammarState, max_forced: int, out: ConstrainedTree | None = None):
        self.src, self.state, self.max_forced = tree, state, max_forced
        self.children = tree.kids()
        self.words = mask_words(state.vocab_size)
        self.choice_nodes = MAX_CHOICE_NODES  # left to add
        root_key = FORCED if tree.certain(0) else tree.keys[0]
        self.out = out or ConstrainedTree(TokenTree([tree.tokens[0]], [-1], [1.0], [root_key]))

    def merge(self, src: int, node: int) -> None:
        """The drafter's node `src` is the output's existing `node` (the state is after it): walk the
        children the output lacks, follow the ones it has."""
        for k in self.children.get(src, []):
            tok = self.src.tokens[k]
            if (have := self.out.tree.child(node, tok)) is not None:
                self.state.advance(tok)
                try:
                    self.merge(k, have)
                finally:
                    self.state.rollback(1)
            elif allows(self.out.rows[node], tok):
                self.descend(k, node, tok, self.src.scores[k], self.src.keys[k], 0)
            else:
                self.out.rejected += subtree_size(self.children, k)

    def visit(self, src: int | None, node: int, chain: int, choices: int = 0) -> None:
        """Node `node` of the output tree (from `src` of the drafter's, None for a node it lacks): record
        its mask, then keep its allowed children (or its forced one) and visit them, and add the
        allowed tokens of a small choice. `chain`: forced nodes added in a row up to here; `choices`:
        choice nodes on the path since the last drafted one."""
        row = np.zeros(self.words, dtype=np.int32)
        self.out.rows.append(row)
        forced = self.state.fill_mask(row)
        kids = [] if src is None else self.children.get(src, [])
        if forced is not None:
            self.follow_forced(kids, node, forced, chain, choices)
            return
        drafted = set()
        for k in kids:
            tok = self.src.tokens[k]
            if not allows(row, tok):
                self.out.rejected += subtree_size(self.children, k)
                continue
            drafted.add(tok)
            self.descend(k, node, tok, self.src.scores[k], self.src.keys[k], 0)
        if choices < MAX_CHOICES_IN_A_ROW and self.choice_nodes > 0 and (few := small_choice(row, SMALL_CHOICE)):
            for tok in few:
                if tok not in drafted and self.choice_nodes > 0:
                    self.choice_nodes -= 1
                    self.out.choices += 1
                    self.descend(None, node, tok, 1.0 / len(few), CHOICE, 0, choices + 1)

    def follow_forced(self, kids: list[int], node: int, forced: int, chain: int, choices: int) -> None:
        """The state forces `forced`: keep the drafted child holding it, else add it (while the chain is
        short enough); every other child is rejected."""
        match = None
        for k in kids:
            if self.src.tokens[k] == forced and match is None:
                match = k
            else:
                self.out.rejected += subtree_size(self.children, k)
        if match is None and chain >= self.max_forced:
            return
        self.out.forced += match is None
        self.descend(match, node, forced, 1.0, FORCED, chain + 1, choices)

    def descend(self, src: int | None, parent: int, tok: int, score: float, key, chain: int, choices: int = 0) -> None:
        if src is None and len(self.out.tree) >= MAX_WALK:
            return
        node = self.out.tree.add(parent, tok, score, key)
        if tok in self.state.eos:  # nothing follows an end token (its row, never read, allows one more)
            row = np.zeros(self.words, dtype=np.int32)
            row[tok >> 5] = np.uint32(1 << (tok & 31)).view(np.int32)
            self.out.rows.append(row)
            return
        self.state.advance(tok)
        try:
            self.visit(src, node, chain, choices)
        finally:
            self.state.rollback(1)


def graft(
    walked: ConstrainedTree, tree: TokenTree, at: int, state: GrammarState, max_forced: int = 16
) -> ConstrainedTree:
    """`walked` (from `constrain`, `state` at its root) with the nodes of `tree` (rooted at `walked`'s
    node `at`) it lacks, walked through the grammar like the rest; `walked` itself is extended."""
    path = walked.tree.paths()[at]
    for tok in path:
        state.advance(tok)
    try:
        Walk(tree, state, max_forced, out=walked).merge(0, at)
    finally:
        state.rollback(len(path))
    return walked


# where a drafter's next token after a word begins a new one, or punctuation, the chance that the model
# closes the string there instead (tuning set, where tested: 13 of 60 before punctuation, 11 of 29 where
# no child began a word; 7 of 48 before words only)
VALUE_END_SCORES = {PUNCT_LED: 0.35, SPACE_LED: 0.12}
MAX_VALUE_END_SITES = 4  # nodes per tree that get the string's closing tokens


def value_end_sites(
    walked: ConstrainedTree, reach: list[float], tokenizer: GrammarTokenizer, first: int
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """The likeliest nodes of `walked` (from node `first` on) inside a JSON string where a word ends and a
    drafted child begins another word or punctuation (a copy of the prompt going on past its phrase),
    and the string's closing tokens the grammar allows there with their scores: (reach × score, node,
    [(token, score)]), best first."""
    tree = walked.tree
    sites = []
    for i, kids in tree.kids().items():
        tok, drafted = tree.tokens[i], {tree.tokens[k] for k in kids}
        if i < first or tok in tokenizer.eos or not tokenizer.word_ends[tok]:
            continue
        lead = max(int(tokenizer.leads[t]) for t in drafted)
        ends = [t for t in tokenizer.value_ends if allows(walked.rows[i], t)]
        if lead and ends and not set(ends) & drafted and small_choice(walked.rows[i], SMALL_CHOICE) is None:
            score = VALUE_END_SCORES[lead]
            sites.append((reach[i] * score, i, [(t, score / len(ends)) for t in ends]))
    return sorted(sites, reverse=True)[:MAX_VALUE_END_SITES]


def add_value_ends(
    walked: ConstrainedTree, reach: list[float], state: GrammarState, first: int, max_forced: int = 16
) -> ConstrainedTree:
    """`walked` (`state` at its root; `reach`: its nodes' chances) with the string's closing tokens at
    its likeliest `value_end_sites`, each followed by the chain it forces (the next key); extended in
    place."""
    for _, node, ends in value_end_sites(walked, reach, state.grammar.tokenizer, first):
        closing = TokenTree.root_only(walked.tree.tokens[node])
        for tok, score in ends:
            closing.add(0, tok, score, CHOICE)
        graft(walked, closing, node, state, max_forced)
    return walked


def constrain(tree: TokenTree, state: GrammarState, max_forced: int = 16) -> ConstrainedTree:
    """`tree` (rooted at the last emitted token; `state`: the grammar after it) less the nodes the
    grammar rejects, plus the nodes it forces; with every node's mask row."""
    walk = Walk(tree, state, max_forced)
    walk.visit(0, 0, 0)
    return walk.out
