"""Output leakage: with the public tail weights the cloud finishes the forward pass itself.

It has every downlink row it computed (prompt included) and the positions, masks and keep lists
the edge sends, so it can mirror the edge's tail KV cache and run layers [L-M, L), the final norm
and the LM head: it reads the edge's next-token choice for every row, hence the generated text
(the keep list names the accepted rows; the last step's keep list is never sent, so there it
checks, row by row from the root, the hypothesis "this draft is the parent row's output" by running
the public head on it and comparing with the row it received). Drafted tokens, accepted or
rejected, are the tree rows' own tokens: the cloud reads them from the uplink (a probe at layer K)
and, for drafts the model agreed with, from the parent row's output.

The check assumes the cloud knows the context's tokens (it recovers the prompt with the uplink
attacks and the earlier output from the downlink): the audit gives it the true ones."""

from __future__ import annotations

import torch

from splitlm.audit.attacks import LinearProbe
from splitlm.audit.traces import Step, Trace
from splitlm.audit.views import sub_stack
from splitlm.model.llama import LayerStack, Transformer, embed


@torch.no_grad()
def cloud_outputs(
    model: Transformer, trace: Trace, tail_layers: int, tail: LayerStack | None = None
) -> list[list[int]]:
    """The cloud's argmax per row of every step, from the downlink through the public (or `tail`) tail."""
    n = model.cfg.num_layers
    stack = tail if tail is not None else sub_stack(model, n - tail_layers, n)
    cache = stack.new_cache()
    out, keep = [], None
    for step in trace.steps:
        if keep is not None:
            cache.keep(keep)
        h = stack(step.hidden[n - tail_layers - 1][None], torch.tensor(step.positions), step.mask, cache)  # [1, T, D]
        out.append(model.logits(h)[0].argmax(-1).tolist())
        keep = step.keep
    return out


def follow(step: Step, outputs: list[int], guesses: list[int]) -> list[int]:
    """The accepted path as the cloud reconstructs it without a keep list: from the root, the child
    whose (guessed) token is the row's output, as long as there is one."""
    parents, path = step.parents(), [0]
    while True:
        nxt = [c for c in range(1, len(step.ids)) if parents[c] == path[-1] and guesses[c] == outputs[path[-1]]]
        if not nxt:
            return path
        path.append(nxt[0])


@torch.no_grad()
def checked_guesses(
    model: Transformer, trace: Trace, index: int, head: int, outputs: list[int], tolerance: float = 1e-3
) -> list[int]:
    """Per row of step `index`: the parent row's output where the public head on it reproduces the
    row's uplink (relative distance below `tolerance`), else -1."""
    step = trace.steps[index]
    stack, parents = sub_stack(model, 0, head), step.parents()
    context = (trace.prompt + trace.generated)[: step.positions[0]]  # before the step's root
    guesses = [step.ids[0]] + [-1] * (len(step.ids) - 1)  # the root is the last token the cloud read
    for c in range(1, len(step.ids)):
        chain, node = [], parents[c]
        while node > 0:
            chain.append(guesses[node] if guesses[node] >= 0 else outputs[parents[node]])
            node = parents[node]
        ids = torch.tensor([context + [step.ids[0]] + chain[::-1] + [outputs[parents[c]]]])
        h = stack(embed(model.embed_tokens, ids, model.cfg), torch.arange(ids.shape[1]))[0, -1]  # [D]
        seen = step.hidden[head - 1][c]
        if float((h - seen).norm() / seen.norm().clamp_min(1e-9)) < tolerance:
            guesses[c] = outputs[parents[c]]
    return guesses


def reconstruct(trace: Trace, outputs: list[list[int]], last_guesses: list[int]) -> list[int]:
    """The generated tokens as the cloud reads them: the prefill's last row, then per step the
    outputs along the keep list (the last step's is never sent: it follows `last_guesses`)."""
    got = [outputs[0][-1]]
    last = len(trace.steps) - 1
    for i, step in enumerate(trace.steps[1:], start=1):
        path = follow(step, outputs[i], last_guesses) if i == last or step.keep is None else step.keep
        got += [outputs[i][r] for r in path]
    return got


def uplink_guesses(trace: Trace, layer: int, probe: LinearProbe) -> list[list[int]]:
    """The probe's top-1 token for every row of every step (from layer `layer`'s output)."""
    return [probe.rank(step.hidden[layer], 1)[:, 0].tolist() for step in trace.steps]


def output_leakage(
    model: Transformer, traces: list[Trace], heads: list[int], tails: list[int], probes: dict[int, LinearProbe]
) -> list[dict]:
    """Rows: the edge's outputs and generated tokens read from the downlink per M (generated: the
    last step's path checked with the public head at K), drafted tokens read from the uplink per K
    and from the parent row's output per M."""
    rows = []
    guesses = {k: [uplink_guesses(t, k - 1, probes[k]) for t in traces] for k in heads if k in probes}
    for m in tails:
        outs = [cloud_outputs(model, t, m) for t in traces]
        agree = total = 0
        for t, o in zip(traces, outs, strict=True):
            for step, oc in zip(t.steps[1:], o[1:], strict=True):
                agree += sum(a == b for a, b in zip(step.out, oc, strict=True))
                total += len(oc)
        rows.append({"kind": "row-outputs", "tail": m, "top1": agree / max(total, 1), "tokens": total})
        for k in guesses:
            hit = n = exact = 0
            for t, o in zip(traces, outs, strict=True):
                last = len(t.steps) - 1
                got = reconstruct(t, o, checked_guesses(model, t, last, k, o[last]) if last > 0 else [])
                ok = [a == b for a, b in zip(t.generated, got + [-1] * len(t.generated), strict=False)]
                hit, n, exact = hit + sum(ok), n + len(ok), exact + all(ok)
            rows.append(
                {
                    "kind": "generated",
                    "tail": m,
                    "head": k,
                    "top1": hit / n,
                    "exact_seq": exact / len(traces),
                    "tokens": n,
                }
            )
        rows.append(
            {
                "kind": "drafts",
                "via": "parent-output",
                "tail": m,
                **draft_recovery(
                    traces,
                    [
                        [[o[p] if p >= 0 else -1 for p in s.parents()] for s, o in zip(t.steps, ot, strict=True)]
                        for t, ot in zip(traces, outs, strict=True)
                    ],
                ),
            }
        )
    for k, g in guesses.items():
        rows.append({"kind": "drafts", "via": "uplink-probe", "head": k, **draft_recovery(traces, g)})
    return rows


def draft_recovery(traces: list[Trace], guesses: list[list[list[int]]]) -> dict:
    """Share of drafted tokens (tree rows after the root) named by `guesses`, overall and among the rejected."""
    hit = n = rej_hit = rej = 0
    for t, g in zip(traces, guesses, strict=True):
        for step, gs in zip(t.steps[1:], g[1:], strict=True):
            kept = set(step.keep or [])
            for c in range(1, len(step.ids)):
                ok = gs[c] == step.ids[c]
                hit, n = hit + ok, n + 1
                if c not in kept:
                    rej_hit, rej = rej_hit + ok, rej + 1
    return {"top1": hit / max(n, 1), "tokens": n, "rejected_top1": rej_hit / max(rej, 1), "rejected": rej}
