"""One pipeline stage of a Ray cloud replica: a contiguous range of the cloud's layers and, per
session, the KV cache of those layers.

A replica's stage 0 (`cloud.ray_replica`) holds the sessions and runs the scheduler; its caches are
`StageCache`s, which record every edit the session logic makes between passes (clear, crop, keep,
retain_last, and the pending-block start set after a step). Each pass ships those edits with the
activations; a later stage (`StageWorker`, a Ray actor) repeats them on its own caches before it
runs its layers, so every stage's caches stay entry for entry what one cache of all the layers
would hold. No Ray import here: the actor classes are wrapped with `ray.remote` where they are
deployed (`cloud.ray_cloud`), so this module loads without the `ray` extra.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from splitlm import SplitLMError
from splitlm.model.config import ModelConfig
from splitlm.model.device import DTYPES, resolve_device, resolve_dtype, to_device, to_host
from splitlm.model.kv_cache import KVCache
from splitlm.model.llama import LayerStack, RMSNorm
from splitlm.model.loading import read_hf_config
from splitlm.model.materialise import assign_weights
from splitlm.model.shards import Manifest
from splitlm.model.weights import shard_weights

log = logging.getLogger(__name__)

RECORDED = ("clear", "crop", "keep", "retain_last")  # the KVCache edits a later stage repeats


def stage_ranges(start: int, end: int, stages: int) -> list[tuple[int, int]]:
    """Layers [start, end) in `stages` contiguous ranges, as even as possible (earlier ones one longer)."""
    n = end - start
    if not 1 <= stages <= n:
        raise SplitLMError(f"--stages must be in [1, {n}] (the cloud shard holds {n} layers), got {stages}")
    ranges, lo = [], start
    for i in range(stages):
        hi = lo + n // stages + (i < n % stages)
        ranges.append((lo, hi))
        lo = hi
    return ranges


class StageCache(KVCache):
    """Stage 0's cache of session `sid`: a KVCache that also records the edits made to it from outside
    (not those a forward makes: every stage makes its own), for the later stages to repeat in order."""

    def __init__(self, num_layers: int, sid: int):
        self._inside = True  # KVCache.__init__ sets pending_start: not an edit
        self.edits: list[tuple] = []
        super().__init__(num_layers)
        self.sid = sid
        self.lane = 0  # the replica's scheduler lane the session's passes run in (`ray_replica.Lanes`)
        self.shipped = False  # the later stages hold this session's caches (it was in a pass)
        self._inside = False

    def _edit(self, name: str, *args):
        if self._inside:  # an edit inside an edit (clear crops): the outer one is what the stages repeat
            return getattr(KVCache, name)(self, *args)
        self.edits.append((name, *args))
        self._inside = True
        try:
            return getattr(KVCache, name)(self, *args)
        finally:
            self._inside = False

    def clear(self) -> None:
        self._edit("clear")

    def crop(self, n: int) -> None:
        self._edit("crop", n)

    def keep(self, indices) -> None:
        self._edit("keep", indices.reshape(-1).tolist() if isinstance(indices, torch.Tensor) else list(indices))

    def retain_last(self, n: int) -> None:
        self._edit("retain_last", n)

    def begin(self, t: int, positions: torch.Tensor | None = None) -> None:
        inside, self._inside = self._inside, True  # part of the forward, which every stage runs itself
        try:
            super().begin(t, positions)
        finally:
            self._inside = inside

    @property
    def pending_start(self) -> int:
        return self._pending_start

    @pending_start.setter
    def pending_start(self, value: int) -> None:
        if not self._inside:  # finish_step marks the new tokens' block
            self.edits.append(("pending", value))
        self._pending_start = value

    def drain(self) -> list[tuple]:
        edits, self.edits = self.edits, []
        return edits


def apply_edits(cache: KVCache, edits: list[tuple]) -> None:
    """Repeat stage 0's edits on a later stage's cache of the same session."""
    for name, *args in edits:
        if name == "pending":
            cache.pending_start = args[0]
        elif name in RECORDED:
            getattr(cache, name)(*args)
        else:
            raise ValueError(f"unknown cache edit {name!r}")


@dataclass
class PassMeta:
    """What a later stage needs besides the activations of one pass: per session (in the pass's
    order) its id, whether this is its first pass, its cache edits, positions and mask; and the
    sessions that ended since the last pass (their caches are freed)."""

    sids: list[int]
    fresh: list[bool]
    edits: list[list[tuple]]
    positions: list[torch.Tensor]  # [T_i] long, host memory
    masks: list[torch.Tensor | None]  # [T_i, T_i] bool or None (causal)
    dropped: list[int] = field(default_factory=list)


class StageModel(nn.Module):
    """Layers [start, end) of the cloud shard (`middle`); with `head_part` in the split-head topology
    also the final norm and the cloud's LM-head columns (the replica's stage 0 finishes each step)."""

    def __init__(self, cfg: ModelConfig, manifest: Manifest, start: int, end: int, head_part: bool = False):
        super().__init__()
        self.cfg, self.manifest = cfg, manifest
        self.split_head = manifest.topology == "split-head"
        self.middle = LayerStack(cfg, start, end)
        if self.split_head and head_part:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
            self.lm_head = nn.Linear(cfg.hidden_size - manifest.d_end, cfg.vocab_size, bias=False)


def read_cloud_shard(shard_dir: str | Path) -> tuple[ModelConfig, Manifest]:
    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        raise SplitLMError(f"shard directory not found: {shard_dir}")
    return ModelConfig.from_hf(read_hf_config(shard_dir)), Manifest.read(shard_dir, "cloud")


def load_stage(
    shard_dir: str | Path,
    start: int,
    end: int,
    device: torch.device,
    dtype: torch.dtype | None,
    head_part: bool = False,
) -> StageModel:
    """Only the weights of layers [start, end) (and the head part) from the cloud shard, on `device`."""
    cfg, manifest = read_cloud_shard(shard_dir)
    lo, hi = manifest.cloud_layers
    if not lo <= start < end <= hi:
        raise SplitLMError(f"stage layers [{start}, {end}) outside the cloud shard's [{lo}, {hi})")
    with torch.device("meta"):
        model = StageModel(cfg, manifest, start, end, head_part)
    return assign_weights(model, shard_weights(Path(shard_dir)), device, dtype or DTYPES[manifest.dtype]).eval()


@dataclass
class StageSpec:
    """Where a stage actor's layers come from and how it runs them."""

    shard_dir: str
    start: int
    end: int
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 1  # torch threads of the actor's process


class StageLost(RuntimeError):
    """A later stage was asked to continue a session whose caches it does not hold (it restarted)."""


class StageWorker:
    """A later pipeline stage (Ray actor): its layers and its caches of the replica's sessions."""

    def __init__(self, spec: StageSpec):
        torch.set_num_threads(spec.threads)
        self.device = resolve_device(spec.device)
        self.model = load_stage(
            spec.shard_dir, spec.start, spec.end, self.device, resolve_dtype(spec.dtype, self.device)
        )
        self.caches: dict[int, KVCache] = {}
        self.lock = threading.Lock()  # run and reset one at a time (ping needs no lock)
        self.incarnation = secrets.token_hex(8)  # a restarted actor has another
        log.info("stage layers [%d, %d) on %s (incarnation %s)", spec.start, spec.end, self.device, self.incarnation)

    def ping(self) -> str:
        return self.incarnation

    def reset(self) -> str:
        """Drop every session's caches (the replica starts afresh); returns the incarnation."""
        with self.lock:
            self.caches.clear()
        return self.incarnation

    @torch.inference_mode()
    def run(self, meta: PassMeta, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One pass of this stage's layers: xs [1, T_i, D] per session -> outputs [1, T_i, D] (host memory)."""
        with self.lock:
            for sid in meta.dropped:
                self.caches.pop(sid, None)
            caches = []
            for sid, fresh, edits in zip(meta.sids, meta.fresh, meta.edits, strict=True):
                cache = self.caches.get(sid)
                if cache is None:
                    if not fresh:
                        raise StageLost(f"session {sid:#x}: this stage holds no cache for it (restarted)")
                    cache = self.caches[sid] = KVCache(len(self.model.middle.layers))
                apply_edits(cache, edits)
                caches.append(cache)
            dev = self.device
            outs = self.model.middle.forward_packed(
                [to_device(x, dev) for x in xs],
                [to_device(p, dev) for p in meta.positions],
                [None if m is None else to_device(m, dev) for m in meta.masks],
                caches,
            )
            return [to_host(o) for o in outs]
