"""Peak memory of one benchmark mode, measured in a fresh process that loads only what it needs.

The bench process itself holds the full `transformers` model (the reference), so its own peak
RSS says nothing about the edge. Instead, for each mode a child process imports the runtime
(torch, transformers, splitlm), notes its RSS (`baseline`), runs the mode once on the longest
prompt (loading the mode's models lazily: the edge shard for split modes, the full model for
local ones) and reports its peak RSS (VmHWM on Linux). The child runs with one torch thread
and talks to the cloud directly (memory does not depend on the RTT).

    python -m splitlm.bench.memory < probe.json   # a MemoryProbe as JSON in, one JSON line out
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 2**20


def _proc_status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss_bytes() -> int | None:
    return _proc_status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Peak RSS of this process. VmHWM (Linux) belongs to the current address space only;
    ru_maxrss is the fallback, but Linux carries it over from the forking parent across exec."""
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


@dataclass
class MemoryProbe:
    """One mode's run in the child process (sent to it as JSON): the models, the cloud (None: none),
    the wire codec, the prompt and the answer's length, the edge's vocabulary, device and dtype."""

    mode: str
    model_dir: str
    edge_dir: str
    cloud_url: str | None
    wire_dtype: str
    prompt_ids: list[int]
    max_new_tokens: int
    vocab: str = "all"
    device: str = "auto"
    dtype: str = "auto"


def probe_memory(probe: MemoryProbe, timeout_s: float = 300) -> dict:
    """Run `probe.mode` once in a child process; returns its memory figures (MiB) or {"error": ...}."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "splitlm.bench.memory"],
            input=json.dumps(asdict(probe)),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"memory probe timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not proc.stdout.strip():
        return {"error": (proc.stderr.strip().splitlines() or ["memory probe failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child() -> None:
    probe = MemoryProbe(**json.loads(sys.stdin.read()))
    import torch
    import transformers  # noqa: F401  (the tokenizer needs it on every edge)

    import splitlm.edge  # noqa: F401
    from splitlm.bench.modes import MODES, BenchContext

    torch.set_num_threads(1)
    baseline = current_rss_bytes()
    ctx = BenchContext(
        probe.model_dir,
        probe.edge_dir,
        probe.cloud_url,
        probe.wire_dtype,
        probe.vocab,
        device=probe.device,
        dtype=probe.dtype,
    )
    try:
        run = MODES[probe.mode].run(ctx, probe.prompt_ids, probe.max_new_tokens)
        weights = ctx.weight_bytes()
    finally:
        ctx.close()
    peak = peak_rss_bytes()
    sys.stdout.write(
        json.dumps(
            {  # the child's result: one JSON line that probe_memory reads
                "peak_rss_mb": round(peak / MiB, 1),
                "baseline_rss_mb": None if baseline is None else round(baseline / MiB, 1),
                "added_mb": None if baseline is None else round((peak - baseline) / MiB, 1),
                "weights_mb": round(sum(weights.values()) / MiB, 1),
                "prompt_tokens": len(probe.prompt_ids),
                "new_tokens": len(run.token_ids),
            }
        )
        + "\n"
    )


if __name__ == "__main__":
    _child()
