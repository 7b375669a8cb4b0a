"""Vocabulary subsets derived from the tokenizer, and allow-list files."""

import pytest
import torch

from splitlm import SplitLMError
from splitlm.edge.vocab import EN_RANGES, ZH_RANGES, _byte_level_alphabet, bytes_allowed, resolve_vocab
from splitlm.transport.errors import ProtocolError
from splitlm.transport.frames import pack_vocab, unpack_vocab


@pytest.mark.parametrize(
    "text, en, zh",
    [
        ("Hello", True, True),
        (" world", True, True),
        ("def f(x):\n\t", True, True),
        ("{}[]<>=+-*/\\|&^%$#@!~`", True, True),
        ("0123", True, True),
        (" café", True, True),
        ("naïve—“quoted”…", True, True),
        ("€", True, True),
        ("数据", False, True),
        ("，", False, True),
        ("。", False, True),
        ("привет", False, False),
        ("ん", False, False),
        ("α", False, False),
        ("ع", False, False),
        ("😀", False, False),
        ("\x02", False, False),
    ],
)
def test_whole_characters(text, en, zh):
    data = text.encode()
    assert bytes_allowed(data, EN_RANGES) is en
    assert bytes_allowed(data, ZH_RANGES) is zh


def test_tokens_that_split_a_character():
    zhong = "中".encode()  # e4 b8 ad
    assert bytes_allowed(zhong[:2], ZH_RANGES) and bytes_allowed(zhong[2:], ZH_RANGES)  # begins / ends a CJK char
    assert bytes_allowed(b"ab" + zhong[:1], ZH_RANGES) and bytes_allowed(zhong[1:] + b"x", ZH_RANGES)
    assert not bytes_allowed(zhong[:2], EN_RANGES)
    assert bytes_allowed("é".encode()[:1], EN_RANGES)  # c3: the start of a Latin-1 letter
    cyrillic = "п".encode()  # d0 bf
    assert not bytes_allowed(cyrillic[:1], EN_RANGES) and not bytes_allowed(cyrillic[:1], ZH_RANGES)
    assert not bytes_allowed(b"\xff", ZH_RANGES)  # never valid UTF-8
    assert not bytes_allowed(b"a\xbfb", ZH_RANGES)  # a stray continuation byte inside
    assert bytes_allowed(zhong[1:2], ZH_RANGES)  # a middle byte alone


def test_byte_level_alphabet_covers_every_byte_once():
    table = _byte_level_alphabet()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["a"] == ord("a")


def test_packed_bits_round_trip():
    allowed = torch.zeros(21, dtype=torch.bool)
    allowed[[0, 7, 8, 20]] = True
    data = pack_vocab(allowed)
    assert len(data) == 3 and data[0] == 0b10000001
    assert unpack_vocab(data, 21).tolist() == [0, 7, 8, 20]
    for bad in (data[:2], data + b"\0", b"\0\0\0", b"\0\0\x01", "abc"):  # length, nothing allowed, padding bit set
        with pytest.raises(ProtocolError):
            unpack_vocab(bad, 21)


def test_bundled_tokenizer_subsets(bundled_hf):
    _, tok = bundled_hf
    v = 49152
    eos = [tok.eos_token_id]
    every, en, zh = (resolve_vocab(name, tok, v, eos) for name in ("all", "en", "zh"))
    assert every.everything and every.size == v
    assert en.size < zh.size < v
    assert bool((en.allowed <= zh.allowed).all())
    assert all(en.allowed[i] for i in tok.all_special_ids)  # special tokens are always allowed
    for word in ("Hello", " the", " function", "():", "\n\n", "123"):
        assert all(en.allowed[i] for i in tok(word).input_ids), word
    zh_ids = tok("我们的数据").input_ids
    assert not all(en.allowed[i] for i in zh_ids) and all(zh.allowed[i] for i in zh_ids)
    ru_ids = tok(" привет").input_ids
    assert not any(zh.allowed[i] for i in ru_ids)
    masked = en.mask_logits(torch.zeros(2, v))
    assert torch.isinf(masked[:, ~en.allowed]).all() and (masked[:, en.allowed] == 0).all()


def test_allow_list_files(tmp_path):
    good = tmp_path / "ids.txt"
    good.write_text("# allowed ids\n5, 6 7\n\n100  # a comment\n")
    sub = resolve_vocab(str(good), None, 256, [2])
    assert sub.ids.tolist() == [2, 5, 6, 7, 100] and sub.name == "ids.txt"
    for content, message in (
        ("5 x", "not a token id"),
        ("256", r"not a token id in \[0, 256\)"),
        ("# none\n", "no token id"),
        ("-1", "not a token id"),
    ):
        bad = tmp_path / "bad.txt"
        bad.write_text(content)
        with pytest.raises(SplitLMError, match=message):
            resolve_vocab(str(bad), None, 256, [2])
    with pytest.raises(SplitLMError, match="not all, en, zh or an allow-list file"):
        resolve_vocab(str(tmp_path / "missing.txt"), None, 256, [2])
    with pytest.raises(SplitLMError, match="has none"):
        resolve_vocab("en", None, 256, [2])
