"""Long jobs draw a progress bar on a terminal (run here under a pseudo-terminal), and none off a
terminal or under --quiet."""

import re
import subprocess
import sys

import pytest

from conftest import make_tiny_llama

pexpect = pytest.importorskip("pexpect")
BAR = re.compile(r"\d+%\|")  # tqdm: "splitting model:  40%|████      | 1.2M/3.0M [...]"


def in_terminal(*args: str) -> tuple[int, str]:
    """Run `splitlm ARGS` in a pseudo-terminal; (exit status, everything it wrote)."""
    child = pexpect.spawn(sys.executable, ["-m", "splitlm", *args], encoding="utf-8", timeout=300, dimensions=(40, 160))
    out = child.read()
    child.close()
    return child.exitstatus, out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("progress-model"), seed=2)


def test_split_shows_progress_on_a_terminal(model, tmp_path):
    status, out = in_terminal("split", "--model", str(model), "--out", str(tmp_path / "a"))
    assert status == 0, out
    assert re.search(r"splitting \S+: +\d+%\|", out), out
    assert "verifying" not in out  # nothing is loaded back


def test_quiet_and_off_a_terminal_there_are_no_bars(model, tmp_path):
    status, out = in_terminal("split", "--model", str(model), "--out", str(tmp_path / "q"), "--quiet")
    assert status == 0
    assert not BAR.search(out) and "splitting" not in out  # no bar, no status line
    assert f"wrote {tmp_path / 'q' / 'edge'}" in out  # the result still prints
    proc = subprocess.run(
        [sys.executable, "-m", "splitlm", "split", "--model", str(model), "--out", str(tmp_path / "p")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and not BAR.search(proc.stderr)
    assert "splitting" in proc.stderr  # status lines stay (logging), bars do not


def test_harden_shows_its_training_steps(model, tmp_path):
    from conftest import save_byte_tokenizer

    save_byte_tokenizer(model)
    docs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    docs[0].write_text("The quick brown fox jumps over the lazy dog. " * 40)
    docs[1].write_text("Pack my box with five dozen liquor jugs. " * 20)
    status, out = in_terminal(
        "harden",
        "--model",
        str(model),
        "--steps",
        "3",
        "--max-train-tokens",
        "512",
        "--corpus",
        *map(str, docs),
        "--out",
        str(tmp_path / "h"),
        "--threads",
        "1",
    )
    assert status == 0, out
    assert re.search(r"harden: +\d+%\|.*\| ?\d/3", out), out
