"""What an audit runs: the head depths, the attacks, the defences, the data's sizes, the traced decoding."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitlm import SplitLMError
from splitlm.audit.defences import Defence, parse_defence
from splitlm.audit.harden import HardenConfig

ATTACKS = ("nn", "lens", "probe", "whitebox")


@dataclass
class AuditConfig:
    heads: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    tail: int = 2
    attacks: list[str] = field(default_factory=lambda: list(ATTACKS))
    defences: list[Defence] = field(default_factory=lambda: [parse_defence("none")])
    seq_len: int = 32
    max_train_tokens: int = 32768
    max_eval_tokens: int = 1024
    whitebox_tokens: int = 256  # held-out tokens the (expensive) white-box search attacks
    down_whitebox_tokens: int = 128
    candidates: int = 64  # tokens the white-box search tries per position
    probe_epochs: int = 2
    mlp_probe_tokens: int = 8192
    harden: HardenConfig = field(default_factory=lambda: HardenConfig(tail=True))
    adaptive: bool = True  # also attack every defence with an attacker that reruns it
    adaptive_mlp: bool = True  # the adaptive attacker trains an MLP probe too (the costliest probe)
    output_prompts: int = 12  # per label (code, prose) traced for the output and metadata audit; 0 = none
    output_tokens: int = 32  # tokens generated per traced prompt
    output_tails: list[int] = field(default_factory=lambda: [1, 2, 4])  # M values for the output leakage
    spec: str = "ngram"  # the drafter of the traced decoding
    seed: int = 0

    def check(self, num_layers: int) -> None:
        for k in self.heads:
            if k < 1 or k + self.tail >= num_layers:
                raise SplitLMError(
                    f"--head {k} with --tail {self.tail} leaves no layer for the cloud (the model has {num_layers})"
                )
            if self.output_prompts and k + max(self.output_tails) >= num_layers:
                raise SplitLMError(
                    f"--head {k} with --output-tails {max(self.output_tails)} leaves no layer for the "
                    f"cloud (the model has {num_layers})"
                )
        unknown = set(self.attacks) - set(ATTACKS)
        if unknown or not self.attacks:
            raise SplitLMError(
                f"unknown attack(s) {', '.join(sorted(unknown)) or '(none given)'}; choose from {', '.join(ATTACKS)}"
            )
        if self.candidates < 5:
            raise SplitLMError("--candidates must be at least 5")
