"""What the cloud sees of real decoding: a step session over the whole model that records every
forward as the cloud would see it (rows, positions, visibility mask, the keep list that comes with
the next request) together with the tokens and the hidden states of chosen layers (the uplink at
layer K's output, the downlink at layer L-M's), so that `output` and `metadata` can attack them.

Tree sizes come from the speculative budget; so that they do not depend on this machine's load,
the session reports a fixed compute model (c0 + c1·T seconds) and a fixed round trip."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitlm.decoding.budget import StepBudget
from splitlm.decoding.local import LocalSession
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.step import StepInput, StepResult
from splitlm.model.llama import Transformer


@dataclass
class Step:
    ids: list[int]  # the rows' tokens (known to the edge only)
    positions: list[int]
    mask: torch.Tensor | None  # [T, T] bool among the rows, None = causal
    out: list[int]  # the edge's argmax per row
    hidden: dict[int, torch.Tensor]  # global layer index -> that layer's output [T, D]
    prefill: bool
    keep: list[int] | None = None  # the accepted path (tree rows), sent with the next request

    def parents(self) -> list[int]:
        """Each row's parent row (-1 for the first): the deepest row it sees before itself."""
        if self.mask is None:
            return list(range(-1, len(self.ids) - 1))
        return [-1] + [int(self.mask[c, :c].nonzero().max()) for c in range(1, len(self.ids))]


@dataclass
class Trace:
    label: str
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)


class TracingSession(LocalSession):
    """A `StepSession` over the whole model recording what the cloud sees (`trace.steps`)."""

    def __init__(
        self,
        model: Transformer,
        layers: set[int],
        trace: Trace,
        c0_s: float = 0.02,
        c1_s: float = 0.005,
        rtt_s: float = 0.08,
    ):
        super().__init__(model)
        self.trace = trace
        self.c0_s, self.c1_s, self.rtt_s = c0_s, c1_s, rtt_s
        self._hidden: dict[int, torch.Tensor] = {}
        self._hooks = [model.stack.layers[i].register_forward_hook(self._hook(i)) for i in sorted(layers)]

    def _hook(self, i: int):
        def hook(_module, _args, output):
            self._hidden[i] = output[0].detach().float().clone()  # [T, D]

        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def settle(self, keep: list[int] | None = None) -> None:
        super().settle(keep)
        self.trace.steps[-1].keep = None if keep is None else list(keep)

    def forward(self, step: StepInput) -> StepResult:
        ids, positions, mask, rows = step.ids, step.positions, step.mask, step.rows
        super().settle(step.keep)  # before the positions: they follow the kept entries
        if positions is None:
            positions = list(range(self.length, self.length + len(ids)))
        logits = super().forward(StepInput(ids, positions, mask)).out  # [T, V], every row: the trace keeps each argmax
        out = logits.argmax(-1)
        self.trace.steps.append(
            Step(
                list(ids),
                list(positions),
                None if mask is None else mask.clone(),
                out.tolist(),
                dict(self._hidden),
                prefill=not self.trace.steps,
            )
        )
        logits = logits if rows is None else logits[rows]
        return StepResult(
            logits.argmax(-1) if step.argmax else logits, len(ids), self.rtt_s, self.c0_s + self.c1_s * len(ids)
        )


def trace_generation(
    model: Transformer, prompt: list[int], label: str, layers: set[int], max_new_tokens: int = 32, spec: str = "ngram"
) -> Trace:
    """Greedy speculative decoding of `prompt` (drafter `spec`), recorded."""
    trace = Trace(label, list(prompt))
    session = TracingSession(model, layers, trace)
    try:
        drafting = Speculation(make_drafter(SpecConfig(mode=spec)), StepBudget())
        request = DecodeRequest(list(prompt), max_new_tokens, set(model.cfg.eos_token_ids), speculation=drafting)
        for new in decode(session, request):
            trace.generated.extend(new)
    finally:
        session.close()
    return trace
