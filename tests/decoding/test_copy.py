"""Copies of the prompt's text (`splitlm.decoding.copy`): drafted in the tokenizer's own split after
a quote, only from the start of a word, under the guide's nodes; `auto` with them still decodes
exactly what sequential decoding does."""

import random

import pytest

from conftest import make_tiny_llama
from splitlm.decoding.auto import DraftMemory
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.copy import CopyDrafter
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.local import LocalSession
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.step import StepResult
from splitlm.decoding.suffix import SuffixIndex
from splitlm.decoding.tree import TokenTree
from splitlm.model.loading import load_model


class PieceTokenizer:
    """A toy tokenizer: the longest piece first, left to right."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces
        self.ids = {p: i for i, p in enumerate(pieces)}
        self.longest = max(map(len, pieces))

    def tokenize_str(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            n = next(n for n in range(min(self.longest, len(text) - i), 0, -1) if text[i : i + n] in self.ids)
            out.append(self.ids[text[i : i + n]])
            i += n
        return out

    def decode_str(self, tokens: list[int]) -> str:
        return "".join(self.pieces[t] for t in tokens)


WORDS = [
    "<s>",
    " penicillin",
    " Maria",
    "Maria",
    " O",
    "ka",
    "for",
    " pen",
    "pen",
    "icillin",
    " and",
    " latex",
    '{"',
    "name",
    '":',
    ' "',
    '",',
    "aria",
]
TOK = PieceTokenizer(WORDS + sorted(set('Note:Maria Okafor, a 54 penicillin and latex.{}"')))
PROMPT = "Note: Maria Okafor, a 54, penicillin and latex."


def drafter_after(output: str) -> tuple[CopyDrafter, list[int]]:
    prompt, out = TOK.tokenize_str(PROMPT), TOK.tokenize_str(output)
    d = CopyDrafter(TOK)
    d.reset(prompt + out[:1])
    d.extend(out[1:])
    return d, out


def best_path(tree: TokenTree) -> list[str]:
    node, path = 0, []
    while kids := [i for i in range(1, len(tree)) if tree.parents[i] == node]:
        node = max(kids, key=lambda i: tree.scores[i])
        path.append(TOK.pieces[tree.tokens[node]])
    return path


def test_a_value_after_a_quote_continues_with_the_prompts_text_in_the_tokenizers_split():
    d, _ = drafter_after('{"name": "Maria')
    assert best_path(d.propose())[:4] == [" O", "ka", "for", ","]
    d, _ = drafter_after('{"name": "pen')  # the prompt's " penicillin" is one piece, the output's two
    assert best_path(d.propose())[:3] == ["icillin", " and", " latex"]


def test_nothing_is_copied_from_inside_a_word_or_outside_a_string():
    for output in ('{"name": "aria', '{"name": "', '{"name":', '{"name": "Mario'):
        d, _ = drafter_after(output)
        assert len(d.propose()) == 1, output


def test_a_number_is_also_copied_without_its_thousands_separators():
    tok = PieceTokenizer(sorted(set('R ,;{}":0123456789abcdefghijklmnopqrstuvwxyz')))
    prompt = tok.tokenize_str("Rent 1,450; 48,000 to 58,000 in 1,2345")

    def copies(output: str) -> list[str]:
        out = tok.tokenize_str(output)
        d = CopyDrafter(tok)
        d.reset(prompt + out[:1])
        d.extend(out[1:])
        return sorted(tok.decode_str(c) for c in d.continuations(out))

    assert copies('{"rent": 14') == ["50; 48000 to"]  # 12 tokens of one character: only the plain text has 14
    assert copies('{"max": 58') == [",000 in 1,23", "000 in 1,234"]  # as the prompt has it, and plain
    assert copies('{"n": 12') == []  # 1,2345 is no grouped number


def test_guided_it_continues_the_guides_best_nodes_and_leaves_their_scores_alone():
    d, out = drafter_after('{"name": "')
    guide = TokenTree.root_only(out[-1])
    maria = guide.add(0, TOK.ids["Maria"], 0.6)
    guide.add(0, TOK.ids["pen"], 0.1)
    tree = d.propose(guide=guide)
    paths = {tuple(TOK.pieces[t] for t in p) for p in tree.paths()}
    assert ("Maria", " O", "ka", "for") in paths and ("pen", "icillin") in paths
    assert tree.scores[tree.child(0, TOK.ids["Maria"])] == 0.0  # `either(0.6, 0)` keeps the guide's 0.6
    assert guide.scores[maria] == 0.6


def test_after_a_chain_it_continues_the_others_first_token_guesses_but_not_the_chain_itself():
    d, out = drafter_after('{"')
    chain = [TOK.ids["name"], TOK.ids['":'], TOK.ids[' "']]  # a forced chain opening a string value
    guide = TokenTree.root_only(out[-1])
    end = guide.add_path(chain, [1.0] * 3)
    guide.add(end, TOK.ids["Maria"], 0.5)  # the head's guess at the value's first token
    guide.add(end, TOK.ids["aria"], 0.4)  # inside a word in the prompt: no copy
    assert d.drafts_after and d.continues_after
    tree = d.propose_after([chain], [0.9], guide=guide)
    paths = {tuple(TOK.pieces[t] for t in p) for p in tree.paths()}
    assert ("name", '":', ' "', "Maria", " O", "ka", "for") in paths
    assert not any(len(p) > 4 and p[3] == "aria" for p in paths)
    assert d.propose_after([chain], [0.9]).paths()[-1] == tuple(chain)  # no guess: nothing after ' "'


def test_its_calibration_learns_which_copies_the_target_took():
    d, _ = drafter_after('{"name": "Maria')
    tree = d.propose()
    d.verified(tree, [0, 1, 2], [TOK.ids[" O"], TOK.ids["ka"], TOK.ids["."]], StepResult(None, len(tree), 0.0, 0.0))
    counts = d.calibration.counts
    assert counts[("copy", 1, 1)] == (1.0, 1.0) and counts[("copy", 2, 1)] == (1.0, 1.0)
    assert counts[("copy", 3, 1)] == (0.0, 1.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("copy"), seed=5, vocab_size=64)
    return load_model(path)[0]


def test_auto_with_copies_decodes_what_sequential_decoding_does(model):
    singles = list('abcdefghijklmnopqrstuvwxyz "{}:,.')
    pairs = [' "', '",', '{"'] + [a + b for a in "aeiou" for b in "nrstlm"]
    text = PieceTokenizer(singles + pairs[: 64 - len(singles)])
    rng = random.Random(3)
    memory = DraftMemory.seeded(SuffixIndex([[rng.randrange(3, 64) for _ in range(200)]]))
    drafter = make_drafter(SpecConfig("auto"), memory=memory, text=text)
    assert drafter.name == "auto(suffix+recycle+copy)"
    for _ in range(4):
        prompt = [rng.randrange(3, 64) for _ in range(rng.randrange(40, 80))]
        outs = []
        for d in (Drafter(), drafter):
            out = []
            for new in decode(
                LocalSession(model),
                DecodeRequest(prompt, 48, set(), speculation=Speculation(d, StepBudget(max_nodes=64), SpecStats())),
            ):
                out += new
            outs.append(out)
        assert outs[0] == outs[1]
    assert memory.copy_calibration.counts  # it drafted, and heard how its copies fared
