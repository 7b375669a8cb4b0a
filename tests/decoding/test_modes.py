"""The `--spec` modes are listed once (`splitlm.decoding.modes.SPEC_MODES`): the CLI, the docs' table
and `SpecConfig` agree with it, every mode builds its drafter, and drafters declare what they can do."""

import re
from pathlib import Path

import pytest
import torch

from splitlm.decoding.auto import AutoDrafter, DraftMemory
from splitlm.decoding.drafters import CombinedDrafter, Drafter, LookaheadDrafter, NgramDrafter
from splitlm.decoding.head import DraftHead, HeadRunner
from splitlm.decoding.modes import SPEC_MODES, SpecConfig, make_drafter, spec_mode

ROOT = Path(__file__).resolve().parents[2]


def docs_modes() -> list[str]:
    """The modes in the table of docs/speculative.md, in order."""
    text = (ROOT / "docs" / "speculative.md").read_text()
    table = text[text.index("| mode | drafts from |") :].split("\n\n")[0].splitlines()[2:]
    return [re.match(r"\| `([^`]+)` \|", row).group(1) for row in table]


def test_the_docs_list_the_registered_modes():
    assert docs_modes() == list(SPEC_MODES)


@pytest.mark.parametrize(
    "command", [["generate", "--edge", "e", "--prompt", "p"], ["chat", "--edge", "e"], ["serve-edge", "--edge", "e"]]
)
def test_the_cli_offers_the_registered_modes(command, capsys, monkeypatch):
    from splitlm.cli import build_parser

    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([command[0], "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--spec {" + ",".join(SPEC_MODES) + "}" in shown
    assert all(f"{m.name}: {m.help}" in shown for m in SPEC_MODES.values())
    assert parser.parse_args(command).spec == "auto"
    for name in SPEC_MODES:
        assert parser.parse_args([*command, "--spec", name]).spec == name
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--spec", "draft"])  # removed: it never paid


def test_spec_config_checks_the_mode():
    for name in SPEC_MODES:
        assert SpecConfig(name).mode == name
    for bad in ("draft", "Auto", ""):
        with pytest.raises(ValueError, match="unknown speculative mode"):
            SpecConfig(bad)
    with pytest.raises(ValueError, match="unknown speculative mode"):
        spec_mode("draft")


def memory_with_head() -> DraftMemory:
    torch.manual_seed(0)
    emb = torch.randn(64, 16)
    return DraftMemory(head=HeadRunner(DraftHead(16, 8, torch.arange(0, 64, 2)), emb, emb))


def test_every_mode_builds_its_drafter():
    memory = memory_with_head()
    for name, mode in SPEC_MODES.items():
        drafter = make_drafter(SpecConfig(name), memory=memory)
        assert isinstance(drafter, Drafter)
        assert drafter.adapts_window == mode.adapts_window
        drafter.reset([3, 4, 5, 3, 4])
        tree = drafter.propose()
        assert tree.tokens[0] == 4
    assert [m.name for m in SPEC_MODES.values() if m.needs_memory] == ["recycle", "suffix", "head", "auto"]
    assert [m.name for m in SPEC_MODES.values() if m.needs_corpus] == ["auto-window"]
    with pytest.raises(ValueError, match="trained draft head"):
        make_drafter(SpecConfig("head"))  # a fresh memory holds no head
    assert make_drafter(SpecConfig("auto")).extras == 8  # without a head: suffix and recycle


def test_drafters_declare_their_capabilities():
    plain = Drafter()
    assert (plain.extras, plain.guided, plain.lookahead, plain.window_gain, plain.adapts_window) == (
        0,
        False,
        None,
        0.0,
        False,
    )
    la = LookaheadDrafter(width=3)
    assert la.lookahead is la
    combined = CombinedDrafter([NgramDrafter(), la])
    assert combined.lookahead is la and not combined.adapts_window
    assert CombinedDrafter([NgramDrafter()]).lookahead is None
    window = make_drafter(SpecConfig("auto-window", window=2))
    assert window.adapts_window and window.lookahead.width == 2
    auto = make_drafter(SpecConfig("auto"), memory=memory_with_head())
    assert isinstance(auto, AutoDrafter)
    assert [d.guided for d in auto.drafters] == [False, False, True]  # the head, last, sees the others' tree
    assert auto.lookahead is None and auto.extras == 8
