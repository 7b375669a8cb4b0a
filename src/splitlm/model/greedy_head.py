"""Greedy token choice without the whole fp32 LM head: a bf16 screen, then fp32 on the few
vocabulary columns that could still win.

A verification pass needs only the argmax of each row's logits `h @ W.T` ([N, D] × [D, V]). On
CPUs with bf16 dot products the bf16 product is 2–3× cheaper than fp32 (half the bytes of W
to read, twice the multiply-adds per instruction). Rounding h and W to bf16 (unit roundoff
u = 2⁻⁸) moves logit j by at most (2u + u²)·Σ|h_i||w_ji| ≤ (2u + u²)·‖h‖·‖w_j‖; accumulating in
fp32 adds at most D·2⁻²⁴ of the same; rounding the product to bf16 adds u·|logit|. A column whose
upper bound lies below some column's lower bound cannot be the argmax. The survivors (typically
one to five of 49k) are recomputed in fp32, so the choice is the fp32 LM head's: the same token,
ties to the lowest id, up to the last-bit differences any change of matrix shape already makes.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from splitlm.model.llama import softcap

U = 2.0 ** -8  # bf16 unit roundoff


def _seconds(fn, reps: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def bf16_pays(weight: torch.Tensor, weight16: torch.Tensor, rows: int = 8) -> bool:
    """Whether a product with `weight16` (bf16) is clearly faster than with `weight` (fp32) on this machine."""
    h = torch.randn(rows, weight.shape[1], device=weight.device)
    h16 = h.to(torch.bfloat16)
    return _seconds(lambda: F.linear(h16, weight16)) < 0.8 * _seconds(lambda: F.linear(h, weight))


class GreedyHead:
    """argmax over the vocabulary of softcap(h @ W.T), optionally restricted to `allowed` ids."""

    def __init__(self, weight: torch.Tensor, cap: float | None = None, screen: bool | None = None):
        self.weight, self.cap = weight, cap  # [V, D]
        # on accelerators the plain head is one fused kernel; the screen's per-row survivors would sync per row
        wanted = screen if screen is not None else weight.device.type == "cpu"
        weight16 = weight.to(torch.bfloat16) if weight.dtype == torch.float32 and wanted else None
        self.screen = weight16 is not None and (screen or bf16_pays(weight, weight16))
        if self.screen:
            self.weight16 = weight16  # [V, D]
            self.col_norm = weight.norm(dim=1)  # [V]
            self.rel = 1.01 * (2 * U + U * U + weight.shape[1] * 2.0 ** -24)

    def _plain(self, h: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        logits = softcap(F.linear(h, self.weight), self.cap)  # [N, V]
        if allowed is not None:
            logits = logits.masked_fill(~allowed, -torch.inf)
        return logits.argmax(-1)

    @torch.inference_mode()
    def argmax(self, h: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """h [N, D] (final-normed) -> token ids [N]; `allowed` [V] bool."""
        return self.candidates(h, allowed)[0]

    @torch.inference_mode()
    def candidates(self, h: torch.Tensor, allowed: torch.Tensor | None = None,
                   k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(argmax [N], and with k > 0 each row's k likeliest ids [N, k], from the screen's bf16 logits
        where it screens: drafting candidates, not exact)."""
        if not self.screen:
            logits = softcap(F.linear(h, self.weight), self.cap)  # [N, V]
            if allowed is not None:
                logits = logits.masked_fill(~allowed, -torch.inf)
            return logits.argmax(-1), (logits.topk(k, -1).indices if k else None)
        y = F.linear(h.to(torch.bfloat16), self.weight16).float()  # [N, V]
        top = None
        if k:
            top = (y if allowed is None else y.masked_fill(~allowed, -torch.inf)).topk(k, -1).indices  # [N, k]
        slack = self.rel * h.norm(dim=1, keepdim=True) * self.col_norm + 1.01 * U * y.abs()  # [N, V]
        low, high = y - slack, y + slack
        if allowed is not None:
            low, high = low.masked_fill(~allowed, -torch.inf), high.masked_fill(~allowed, -torch.inf)
        survivors = high >= low.max(dim=1, keepdim=True).values  # [N, V]
        out = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        for r in range(h.shape[0]):
            ids = survivors[r].nonzero()[:, 0]  # ascending, so ties go to the lowest id
            if ids.numel() == 0:  # NaN in the row: no bound holds, the plain head decides
                out[r] = self._plain(h[r:r + 1], allowed)[0]
                continue
            exact = softcap(F.linear(h[r:r + 1], self.weight[ids])[0], self.cap)  # [S]
            out[r] = ids[exact.argmax()]
        return out, top
