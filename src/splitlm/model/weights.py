"""Safetensors weights on disk: find the files of a checkpoint or a shard, read tensors one at a
time from memory maps, and write bounded files as a stream.

A Hugging Face checkpoint is `model.safetensors.index.json` (its `weight_map`) or every
`*.safetensors` file of the directory. A shard is `weights.safetensors.index.json` plus
`weights-00001-of-0000N.safetensors`, ..., or (shards split before the index existed) one
`weights.safetensors`. Every header is read, and checked against its file's size, when the
files are found, so that a missing or truncated file fails at once with its name.

Memory: `safe_open` maps a file; every page a tensor touches counts in RSS until that file's map
goes away (when its handle and every tensor viewing it are gone). `Weights.read` opens the file
for one tensor; `Weights.load` keeps one map per file while it hands out views, and drops the map
after each tensor it had to copy (a cast, another device), so a load holds at most the tensors it
returns plus one source tensor. Writing emits the header first and then each tensor's bytes, so
a writer holds one tensor at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from splitlm import SplitLMError
from splitlm.progress import bar

HF_INDEX = "model.safetensors.index.json"
SHARD_PREFIX = "weights"  # a shard's files: weights-00001-of-00003.safetensors, ..., weights.safetensors.index.json
LEGACY_SHARD_FILE = "weights.safetensors"
DEFAULT_MAX_FILE_MB = 512
MAX_HEADER_BYTES = 100 * 2**20

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_CODES = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as a safetensors header describes it."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorInfo(TensorSpec):
    file: Path = Path()


@dataclass(frozen=True)
class Piece:
    """A tensor to write: the stored tensor `source`, or its columns [cols[0], cols[1])."""

    source: str
    cols: tuple[int, int] | None = None

    def spec(self, info: TensorSpec, dtype: torch.dtype | None) -> TensorSpec:
        shape = info.shape if self.cols is None else (*info.shape[:-1], self.cols[1] - self.cols[0])
        return TensorSpec(dtype if dtype is not None and info.dtype.is_floating_point else info.dtype, shape)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(size - 8, MAX_HEADER_BYTES):
                raise ValueError("no complete safetensors header")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise SplitLMError(f"weight file missing: {path}") from None
    except OSError as e:
        raise SplitLMError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SplitLMError(f"{path} is not a valid safetensors file (truncated or damaged: {e})") from None
    data_bytes = size - 8 - n
    infos = {}
    try:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in ST_DTYPES:
                raise SplitLMError(f"{path}: tensor {name} has a dtype splitlm does not read ({entry['dtype']})")
            info = TensorInfo(ST_DTYPES[entry["dtype"]], tuple(entry["shape"]), path)
            begin, end = entry["data_offsets"]
            if end - begin != info.nbytes or end > data_bytes:
                raise ValueError(
                    f"tensor {name} lies past the end of the file"
                    if end > data_bytes
                    else f"tensor {name} has {end - begin} bytes, its shape needs {info.nbytes}"
                )
            infos[name] = info
    except (KeyError, TypeError, ValueError) as e:
        raise SplitLMError(f"{path} is not a valid safetensors file (truncated or damaged: {e})") from None
    return infos


class Weights:
    """The tensors of a checkpoint or shard directory: name -> dtype, shape and file."""

    def __init__(self, root: Path, tensors: dict[str, TensorInfo]):
        self.root, self.tensors = root, tensors

    @classmethod
    def from_files(cls, root: Path, files: Iterable[Path], weight_map: dict[str, str] | None = None) -> Weights:
        tensors: dict[str, TensorInfo] = {}
        for path in files:
            for name, info in read_header(path).items():
                tensors.setdefault(name, info)
        for name, file in (weight_map or {}).items():
            if name not in tensors or tensors[name].file != root / file:
                raise SplitLMError(f"{root}: the index places {name} in {file}, which does not hold it")
        return cls(root, tensors)

    @property
    def files(self) -> list[Path]:
        return sorted({info.file for info in self.tensors.values()})

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        return sum(self.tensors[n].nbytes for n in (self.tensors if names is None else names))

    def dominant_dtype(self) -> torch.dtype:
        """The floating dtype holding the most elements (a checkpoint's own dtype)."""
        count: dict[torch.dtype, int] = {}
        for info in self.tensors.values():
            if info.dtype.is_floating_point:
                count[info.dtype] = count.get(info.dtype, 0) + prod(info.shape)
        if not count:
            raise SplitLMError(f"{self.root}: no floating-point weights")
        return max(count, key=count.__getitem__)

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise SplitLMError(f"{self.root}: no tensor {name!r} in the weights")
        return self.tensors[name]

    def read(self, name: str) -> torch.Tensor:
        """One tensor, a view of its file's map, opened for it alone (the map lives as long as the tensor)."""
        info = self._info(name)
        with _open(info.file) as f:
            return _get(f, info.file, name)

    def load(
        self,
        names: Iterable[str],
        convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, convert(tensor)) for each name, file by file. A tensor `convert` returns as it is
        stays a view of the map; after a copy the map is dropped, so the source pages leave RSS."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._info(name).file, []).append(name)
        for path, group in sorted(by_file.items()):
            handle = None
            for name in group:
                if handle is None:
                    handle = _open(path)
                view = _get(handle, path, name)
                out = convert(view)
                if out is not view:
                    del view
                    handle = None
                yield name, out
            del handle


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise SplitLMError(f"cannot read {path}: {e}") from None


def _get(handle, path: Path, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except SafetensorError as e:
        raise SplitLMError(f"cannot read {name} from {path}: {e}") from None


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("weight_map is not a table of file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SplitLMError(f"{index}: not a valid safetensors index ({e})") from None
    return weight_map


def _indexed(root: Path, index: Path) -> Weights:
    weight_map = _weight_map(index)
    return Weights.from_files(root, [root / f for f in sorted(set(weight_map.values()))], weight_map)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """A Hugging Face directory's weight files: those its index lists, else every *.safetensors."""
    model_dir = Path(model_dir)
    if (model_dir / HF_INDEX).is_file():
        return [model_dir / f for f in sorted(set(_weight_map(model_dir / HF_INDEX).values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SplitLMError(f"{model_dir}: no *.safetensors weights found")
    return files


def checkpoint_weights(model_dir: Path) -> Weights:
    model_dir = Path(model_dir)
    if (model_dir / HF_INDEX).is_file():
        return _indexed(model_dir, model_dir / HF_INDEX)
    return Weights.from_files(model_dir, checkpoint_files(model_dir))


def file_sha256(paths: list[Path], done: Callable[[int], None] = lambda n: None) -> str:
    """The SHA-256 of the files' bytes one after the other, read in 4 MiB chunks (`done(bytes)` after each)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
                done(len(chunk))
    return digest.hexdigest()


def verify_checksums(shard_dir: Path, index: Path) -> None:
    """Every file the index has a SHA-256 for must still have it (shards written before checksums
    carry none and are not checked). Files are hashed in parallel (`hashlib` releases the GIL): an 8B
    shard's 24 GB would take a core 10-15 s, a cloud's restart after a crash included."""
    try:
        checksums = json.loads(index.read_text()).get("metadata", {}).get("sha256", {})
    except (OSError, ValueError, AttributeError) as e:
        raise SplitLMError(f"{index}: not a valid safetensors index ({e})") from None
    names = sorted(checksums)
    for name in names:
        if not (shard_dir / name).is_file():
            raise SplitLMError(f"{shard_dir / name}: missing (the shard's index lists it); split the model again")
    lock = threading.Lock()
    with bar(
        sum((shard_dir / f).stat().st_size for f in names), f"verifying {shard_dir.name}", unit_bytes=True
    ) as shown:

        def progress(n: int) -> None:
            with lock:
                shown.update(n)

        with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1, 8))) as pool:
            digests = list(pool.map(lambda name: file_sha256([shard_dir / name], progress), names))
    for name, digest in zip(names, digests, strict=True):
        if digest != checksums[name]:
            raise SplitLMError(
                f"{shard_dir / name}: checksum mismatch (the file is damaged or was changed after it "
                "was written); split the model again"
            )


def shard_weights(shard_dir: Path, verify: bool = True) -> Weights:
    """A shard's weights: its index and files, or the one `weights.safetensors` of older shards.
    `verify`: check the files' SHA-256 checksums first (a corrupt file is an error, not NaNs later)."""
    shard_dir = Path(shard_dir)
    index = shard_dir / f"{SHARD_PREFIX}.safetensors.index.json"
    if index.is_file():
        if verify:
            verify_checksums(shard_dir, index)
        return _indexed(shard_dir, index)
    if (shard_dir / LEGACY_SHARD_FILE).is_file():
        return Weights.from_files(shard_dir, [shard_dir / LEGACY_SHARD_FILE])
    raise SplitLMError(f"{shard_dir}: the shard has no weights ({index.name} is missing)")


def read_shard_state(shard_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a shard (views of the files' maps): for small models and tests."""
    weights = shard_weights(shard_dir)
    return dict(weights.load(weights.tensors))


# --- writing ------------------------------------------------------------------------------------


def plan_files(specs: dict[str, TensorSpec], max_file_bytes: int) -> list[list[str]]:
    """Consecutive groups of names of at most `max_file_bytes` each (a larger tensor gets a file of its own)."""
    files: list[list[str]] = []
    size = 0
    for name, spec in specs.items():
        if not files or (size + spec.nbytes > max_file_bytes and files[-1]):
            files.append([])
            size = 0
        files[-1].append(name)
        size += spec.nbytes
    return files


def write_safetensors(
    path: Path,
    specs: dict[str, TensorSpec],
    produce: Callable[[str], torch.Tensor],
    done: Callable[[int], None] = lambda n: None,
) -> str:
    """Write a safetensors file from its header out, one tensor at a time (`produce(name)`, on demand);
    return the file's SHA-256 (hashed as it is written)."""
    names = sorted(specs, key=lambda n: -specs[n].dtype.itemsize)  # widest first: every tensor stays aligned
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        spec = specs[name]
        header[name] = {
            "dtype": ST_CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(text).to_bytes(8, "little"), text):
            f.write(chunk)
            digest.update(chunk)
        for name in names:
            t = produce(name)
            spec = specs[name]
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise ValueError(f"{name}: produced {t.dtype} {tuple(t.shape)}, planned {spec.dtype} {spec.shape}")
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(data)
            digest.update(data)
            done(spec.nbytes)
            del t, data
    return digest.hexdigest()


def write_weights(
    out_dir: Path,
    specs: dict[str, TensorSpec],
    produce: Callable[[str], torch.Tensor],
    max_file_mb: float = DEFAULT_MAX_FILE_MB,
    prefix: str = SHARD_PREFIX,
    done: Callable[[int], None] = lambda n: None,
) -> list[Path]:
    """`prefix`-00001-of-0000N.safetensors, ... of at most `max_file_mb` MiB each, and
    `prefix`.safetensors.index.json, in `out_dir`. Each file is written under a temporary name
    and renamed (never truncated in place, so maps of the files it replaces stay valid); the
    index comes last, and then older files of that prefix are removed."""
    out_dir = Path(out_dir)
    groups = plan_files(specs, int(max_file_mb * 2**20))
    n = len(groups)
    weight_map: dict[str, str] = {}
    checksums: dict[str, str] = {}
    written = []
    for i, group in enumerate(groups, 1):
        path = out_dir / f"{prefix}-{i:05d}-of-{n:05d}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp")
        checksums[path.name] = write_safetensors(tmp, {name: specs[name] for name in group}, produce, done)
        os.replace(tmp, path)
        weight_map.update(dict.fromkeys(group, path.name))
        written.append(path)
    index = out_dir / f"{prefix}.safetensors.index.json"
    tmp = index.with_name(f".{index.name}.tmp")
    tmp.write_text(
        json.dumps(
            {
                "metadata": {"total_size": sum(s.nbytes for s in specs.values()), "sha256": checksums},
                "weight_map": weight_map,
            },
            indent=2,
        )
    )
    os.replace(tmp, index)
    for old in out_dir.glob(f"{prefix}*.safetensors"):
        if old not in written:
            old.unlink()
    return written


def write_state(
    out_dir: Path, state: dict[str, torch.Tensor], max_file_mb: float = DEFAULT_MAX_FILE_MB, prefix: str = SHARD_PREFIX
) -> list[Path]:
    """`write_weights` for tensors already in memory."""
    specs = {name: TensorSpec(t.dtype, tuple(t.shape)) for name, t in state.items()}
    return write_weights(out_dir, specs, state.__getitem__, max_file_mb, prefix)
