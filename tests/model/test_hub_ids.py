"""`--model owner/name`: a Hugging Face id, resolved through huggingface_hub's cache (HF_HOME);
HF_HUB_OFFLINE honoured; one clear line, not a traceback, when the model is not to be had."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_tiny_llama
from splitlm.model.loading import HUB_ID

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(home: Path, repo_id: str, model_dir: Path) -> Path:
    """The layout huggingface_hub writes: hub/models--owner--name/{refs/main, snapshots/<commit>/...}."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def split_cli(model: str, out: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, "-m", "splitlm", "split", "--model", model, "--head", "1", "--tail", "1", "--out", str(out)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_an_id_in_the_cache_is_split_offline(tmp_path):
    snapshot = fake_hub_cache(tmp_path / "hf", "tiny-org/tiny-llama", make_tiny_llama(tmp_path / "tiny"))
    run = split_cli("tiny-org/tiny-llama", tmp_path / "split", tmp_path / "hf")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "split" / "edge" / "manifest.json").is_file()
    assert (tmp_path / "split" / "cloud" / "manifest.json").is_file()
    assert snapshot.is_dir()


def test_an_id_not_in_the_cache_offline_is_one_clear_line(tmp_path):
    run = split_cli("nobody/no-such-model", tmp_path / "split", tmp_path / "hf")
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if "no-such-model" in line]
    assert len(lines) == 1 and "HF_HUB_OFFLINE is set" in lines[0] and "not in the local Hugging Face cache" in lines[0]
    assert not (tmp_path / "split").exists()


@pytest.mark.parametrize("spec", ["Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "a/b"])
def test_hub_ids(spec):
    assert HUB_ID.fullmatch(spec)


@pytest.mark.parametrize("spec", ["model", "/abs/path", "./rel/dir", "a/b/c", "x.gguf"])
def test_not_hub_ids(spec):
    assert not HUB_ID.fullmatch(spec)
