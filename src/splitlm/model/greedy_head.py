"""Greedy token choice without the whole fp32 LM head: a bf16 screen, then fp32 on the few
vocabulary columns that could still win.

A verification pass needs only the argmax of each row's logits `h @ W.T` ([N, D] × [D, V]). On
CPUs with bf16 dot products the bf16 product is 2–4× cheaper than fp32 (half the bytes of W to
read, twice the multiply-adds per instruction; it goes through oneDNN's blocked copy of W,
`linear.frozen_product`: 18 -> 8 ms for one row, 27 -> 15 ms for ten, on the bundled model here).
Rounding h and W to bf16 (unit roundoff u = 2⁻⁸) moves logit j by at most
(2u + u²)·Σ|h_i||w_ji| ≤ (2u + u²)·‖h‖·‖w_j‖; accumulating in fp32 adds at most D·2⁻²⁴ of the
same; rounding the product to bf16 adds u·|logit|. A column whose upper bound lies below some column's lower bound
cannot be the argmax. The columns
whose bf16 logit, with its own rounding slack and the largest norm term any column has, still
reaches the best column's lower bound (a superset of those that could win, one to ~100 of 49k per
row on the bundled model; one comparison per column, no pass for bounds) are recomputed in fp32, so
the choice is the fp32 LM head's: the same token, ties to the lowest id, up to the last-bit
differences any change of matrix shape already makes.
"""

from __future__ import annotations

import time

import torch

from splitlm.model.linear import KeptWeightProduct, frozen_product
from splitlm.model.llama import softcap

U = 2.0**-8  # bf16 unit roundoff


def _seconds(fn, reps: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def bf16_pays(weight: torch.Tensor, product16, product32, rows: int = 8) -> bool:
    """Whether `product16` (h -> bf16 logits, the screen's own product) is clearly faster than the
    fp32 product `product32` with `weight` on this machine."""
    h = torch.randn(rows, weight.shape[1], device=weight.device)
    return _seconds(lambda: product16(h)) < 0.8 * _seconds(lambda: product32(h))


class GreedyHead:
    """argmax over the vocabulary of softcap(h @ W.T), optionally restricted to `allowed` ids."""

    def __init__(self, weight: torch.Tensor, cap: float | None = None, screen: bool | None = None):
        self.weight, self.cap = weight, cap  # [V, D]
        self.product = KeptWeightProduct(weight)  # h [N, D] -> fp32 logits [N, V]
        # on accelerators the plain head is one fused kernel; the screen's per-row survivors would sync per row
        wanted = screen if screen is not None else weight.device.type == "cpu"
        product16 = frozen_product(weight.to(torch.bfloat16)) if weight.dtype == torch.float32 and wanted else None
        self.screen = product16 is not None and (screen or bf16_pays(weight, product16, self.product))
        if self.screen:
            self.screen_product = product16  # h [N, D] -> bf16 logits [N, V]
            self.col_norm = weight.norm(dim=1)  # [V]
            self.col_max = self.col_norm.max()
            self.rel = 1.01 * (2 * U + U * U + weight.shape[1] * 2.0**-24)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, D] (final-normed) -> the fp32 logits [N, V]."""
        return softcap(self.product(h), self.cap)

    def _plain(self, h: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        logits = self.logits(h)  # [N, V]
        if allowed is not None:
            logits = logits.masked_fill(~allowed, -torch.inf)
        return logits.argmax(-1)

    @torch.inference_mode()
    def argmax(self, h: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """h [N, D] (final-normed) -> token ids [N]; `allowed` [V] or per row [N, V] bool."""
        return self.candidates(h, allowed)[0]

    @torch.inference_mode()
    def candidates(
        self, h: torch.Tensor, allowed: torch.Tensor | None = None, k: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(argmax [N], and with k > 0 each row's k likeliest ids [N, k], from the screen's bf16 logits
        where it screens: drafting candidates, not exact)."""
        if not self.screen:
            logits = self.logits(h)  # [N, V]
            if allowed is not None:
                logits = logits.masked_fill(~allowed, -torch.inf)
            return logits.argmax(-1), (logits.topk(k, -1).indices if k else None)
        y = self.screen_product(h).float()  # [N, V]
        hn = h.norm(dim=1, keepdim=True)  # [N, 1]
        if allowed is not None:
            y = y.masked_fill(~allowed, -torch.inf)
        top = y.topk(k, -1).indices if k else None  # [N, k], the largest first
        best = top[:, :1] if k else y.argmax(dim=1, keepdim=True)  # [N, 1]: any column with the largest y
        y_best = y.gather(1, best)
        # column j's upper bound is y_j + c·|y_j| + rel·‖h‖·‖w_j‖ (c = 1.01·u), at most
        # g(y_j) + rel·‖h‖·max‖w‖ with g(y) = y + c·|y| increasing: it reaches the best column's lower
        # bound only if g(y_j) >= b, that is y_j >= g⁻¹(b), the `floor`
        c = 1.01 * U
        best_low = y_best - (self.rel * hn * self.col_norm[best] + c * y_best.abs())
        b = best_low - self.rel * hn * self.col_max  # [N, 1]
        floor = torch.where(b >= 0, b / (1 + c), b / (1 - c))
        rows, cols = (y >= floor).nonzero(as_tuple=True)  # [P] each, ascending ids within a row
        n = h.shape[0]
        exact = softcap((h[rows] * self.weight[cols]).sum(-1), self.cap)  # [P]: fp32 logits of the few left
        row_max = torch.full((n,), -torch.inf, device=h.device).scatter_reduce(0, rows, exact, "amax")
        wins = exact == row_max[rows]
        vocab = self.weight.shape[0]
        out = torch.full((n,), vocab, dtype=torch.long, device=h.device)
        out = out.scatter_reduce(0, rows[wins], cols[wins], "amin")  # ties go to the lowest id
        for r in (out == vocab).nonzero()[:, 0].tolist():  # NaN in the row: no bound holds, the plain head decides
            out[r] = self._plain(
                h[r : r + 1], allowed if allowed is None or allowed.dim() == 1 else allowed[r : r + 1]
            )[0]
        return out, top
