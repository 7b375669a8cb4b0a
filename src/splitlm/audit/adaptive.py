"""Adaptive attackers: the cloud knows the defence procedure, not the edge's seed, data or private
weights, and reruns it on its own copy. Its probes learn from its own defended activations of
public text, and its white-box search models the defence:

- `noise:S`: the attacker adds noise with its own seed to train on, and scores white-box
  candidates by the Gaussian likelihood of the observed activation under the candidate's noise
  scale (`Defence.score`);
- `quant:B`: it quantises its own activations the same way, and compares quantised candidates;
- `harden`: it hardens its own copy of the public head (and tail) with the same procedure on its
  own public text and seed, and attacks with that copy (probes on its activations, white-box
  search through its layers and the public ones, a candidate scoring its best over both; its
  tail on the downlink).

It keeps what the fixed attacker knows: its white-box search also tries the fixed attacks' guesses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from splitlm.audit.attacks import l2_score
from splitlm.audit.defences import Defence
from splitlm.audit.harden import HardenConfig, harden_head
from splitlm.audit.views import SplitView, batched
from splitlm.model.llama import LayerStack


@dataclass
class Attacker:
    head: LayerStack  # the layers it believes produce the uplink: the public ones or its own hardened copy
    search: list[LayerStack]  # the layers its white-box search runs (harden: its copy and the public head)
    tail: LayerStack  # the tail it runs on the downlink
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # white-box ranking (lower = likelier)
    defend: Callable[[torch.Tensor], torch.Tensor]  # its copy of the defence on its own uplink [B, T, D]
    seconds: float = 0.0  # what building it cost

    def uplink(self, view: SplitView, ids: torch.Tensor) -> torch.Tensor:
        """Its own defended activations [B, T, D] of token ids [B, T]."""
        return self.defend(batched(lambda x: self.head(view.embed(x), torch.arange(x.shape[1])), ids))


def public_attacker(view: SplitView) -> Attacker:
    """The non-adaptive attacker: public weights, L2 distance, no defence modelled."""
    return Attacker(view.public_head, [view.public_head], view.public_tail, l2_score, lambda h: h)


def adaptive_attacker(
    view: SplitView, defence: Defence, own_text: torch.Tensor, harden: HardenConfig, seed: int
) -> Attacker:
    """Rerun `defence` on the attacker's own copy (own text [N, S], own seed)."""
    t0 = time.perf_counter()
    if defence.kind == "harden":
        result = harden_head(view, own_text, replace(harden, seed=seed))
        tail = result.tail if result.tail is not None else view.public_tail
        return Attacker(
            result.head, [result.head, view.public_head], tail, l2_score, lambda h: h, time.perf_counter() - t0
        )
    return Attacker(
        view.public_head, [view.public_head], view.public_tail, defence.score, lambda h: defence.apply(h, seed=seed)
    )
