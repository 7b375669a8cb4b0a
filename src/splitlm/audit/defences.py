"""Defences: what changes in the activations the cloud receives, and what each costs.

- `none`: the plain split.
- `noise:S`: Gaussian noise with standard deviation S x the activation's RMS (per token).
- `quant:B`: per-token symmetric B-bit quantisation of the uplink (absmax scale).
- `harden` / `harden:STEPS`: a private head (see `harden.py`): its activations differ from what
  the public weights produce while the model's output is kept.
More local layers (a larger K) is a defence too; its cost is in the depth table of the report.

`score` is how an adaptive white-box attacker, who knows the defence (not its seed), ranks a
candidate activation against the observed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitlm import SplitLMError


@dataclass(frozen=True)
class Defence:
    kind: str  # none | noise | quant | harden
    value: float = 0.0  # noise scale, quantisation bits or harden steps

    @property
    def name(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "harden":
            return "harden" if not self.value else f"harden:{int(self.value)}"
        value = int(self.value) if self.kind == "quant" else f"{self.value:g}"
        return f"{self.kind}:{value}"

    def apply(self, h: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """The uplink activations [B, T, D] as they leave the edge (harden acts inside the head instead)."""
        if self.kind == "noise":
            gen = torch.Generator().manual_seed(seed)
            rms = h.float().pow(2).mean(-1, keepdim=True).sqrt()
            return (h + self.value * rms * torch.randn(h.shape, generator=gen)).to(h.dtype)
        if self.kind == "quant":
            levels = 2 ** (int(self.value) - 1) - 1
            scale = h.abs().amax(-1, keepdim=True).clamp_min(1e-12) / levels
            return (torch.round(h / scale).clamp(-levels, levels) * scale).to(h.dtype)
        return h

    def score(self, cand: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """cand [b, n, D] candidate activations, target [b, D] observed -> [b, n], lower = likelier.

        noise: the Gaussian negative log-likelihood with the candidate's own noise scale; quant:
        the distance after quantising the candidate the same way (ties, common at few bits, broken
        by the plain distance); otherwise the L2 distance."""
        cand, target = cand.float(), target[:, None].float()
        if self.kind == "noise" and self.value > 0:
            sigma = (self.value * cand.pow(2).mean(-1).sqrt()).clamp_min(1e-12)  # [b, n]
            return (cand - target).pow(2).sum(-1) / (2 * sigma**2) + cand.shape[-1] * sigma.log()
        if self.kind == "quant":
            return (self.apply(cand) - target).pow(2).sum(-1) + 1e-3 * (cand - target).pow(2).sum(-1)
        return (cand - target).pow(2).sum(-1)

    def wire_bytes_per_token(self, hidden_size: int) -> float:
        """Uplink bytes per token (fp16 on the wire; quantised: B bits per value + an fp16 scale)."""
        if self.kind == "quant":
            return hidden_size * self.value / 8 + 2
        return hidden_size * 2.0


def parse_defence(text: str) -> Defence:
    kind, _, value = text.strip().partition(":")
    try:
        if kind == "none" and not value:
            return Defence("none")
        if kind == "noise" and value and float(value) >= 0:
            return Defence("noise", float(value))
        if kind == "quant" and value and 2 <= int(value) <= 16:
            return Defence("quant", float(int(value)))
        if kind == "harden":
            steps = int(value) if value else 0
            if steps >= 0:
                return Defence("harden", float(steps))
    except ValueError:
        pass
    raise SplitLMError(
        f"unknown defence {text!r} (use none, noise:S with S >= 0, quant:B with 2 <= B <= 16, harden or harden:STEPS)"
    )


def parse_defences(text: str) -> list[Defence]:
    defences = [parse_defence(t) for t in text.split(",") if t.strip()]
    if not defences:
        raise SplitLMError("--defence needs at least one defence")
    return list(dict.fromkeys(defences))
