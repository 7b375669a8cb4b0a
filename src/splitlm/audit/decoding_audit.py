"""The audit of real decoding: the code and prose prompts decoded speculatively and recorded, then the
output leakage (`output.py`) and the metadata (`metadata.py`) attacked on the traces."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from splitlm.audit.attacks import LinearProbe
from splitlm.audit.config import AuditConfig
from splitlm.audit.metadata import metadata_audit
from splitlm.audit.output import checked_guesses, cloud_outputs, output_leakage, reconstruct
from splitlm.audit.prompts import CODE, PROSE
from splitlm.audit.traces import trace_generation
from splitlm.model.llama import Transformer

log = logging.getLogger(__name__)


def trace_audit(
    model: Transformer, encode: Callable[[str], list[int]], config: AuditConfig, probes: dict[int, LinearProbe], stages
) -> dict:
    """Decode the code and prose prompts speculatively, recorded; attack the outputs and the metadata."""
    t0 = time.perf_counter()
    n = model.cfg.num_layers
    heads = [k for k in config.heads if k in probes]
    layers = {k - 1 for k in heads} | {n - m - 1 for m in config.output_tails}
    prompts = [("code", p) for p in CODE[: config.output_prompts]] + [
        ("prose", p) for p in PROSE[: config.output_prompts]
    ]
    stages.set_postfix_str("tracing decoding")
    traces = [
        trace_generation(model, encode(p), label, layers, config.output_tokens, config.spec) for label, p in prompts
    ]
    log.info(
        f"[audit] traced {len(traces)} generations ({sum(len(t.generated) for t in traces)} tokens, "
        f"{sum(len(t.steps) - 1 for t in traces)} steps) in {time.perf_counter() - t0:.0f} s"
    )
    stages.update()
    stages.set_postfix_str("output leakage")
    output_rows = output_leakage(model, traces, heads, config.output_tails, probes)
    estimated = None
    if heads:  # the cloud's own count: the keep lists it was sent, then the last step's path it checks
        k = heads[min(1, len(heads) - 1)]
        estimated = []
        for t in traces:
            outs, last = cloud_outputs(model, t, config.tail), len(t.steps) - 1
            estimated.append(len(reconstruct(t, outs, checked_guesses(model, t, last, k, outs[last]) if last else [])))
    meta = metadata_audit(traces, estimated, config.output_tokens)
    stages.update()
    log.info(f"[audit] output leakage and metadata in {time.perf_counter() - t0:.0f} s")
    return {"output": output_rows, "metadata": meta, "trace_s": round(time.perf_counter() - t0, 1)}
