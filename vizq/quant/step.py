"""A calibrated per-tensor quantizer turned into a monotone step function, bit-exact.

Inference then costs one binary search per value (``torch.bucketize``) and a table lookup,
whatever the quantizer's formula (log2, log√2, AdaLog, SULQ, TanQ, FP formats, uniform):
several times faster than evaluating log/exp per element. The thresholds are found by
bisection over float32 bit patterns on the quantizer's own ``fake_quant``, so the step
function returns exactly what ``fake_quant`` returns for every float; a quantizer that is not
monotone (or not per-tensor) is refused and keeps its direct path.
"""
from __future__ import annotations

import torch

from .base import Quantizer

Tensor = torch.Tensor
#: Families whose formulas (log/exp, format tables) are slower than a binary search; uniform
#: grids already have a fused one-pass kernel (see UniformQuantizer._fused).
STEP_FAMILIES = ("log", "float")
_SIGN = 0x80000000
_MAG = 0x7FFFFFFF


def _to_key(f: Tensor) -> Tensor:
    """Order-preserving map float32 -> int64 (bit pattern, negatives mirrored)."""
    b = f.contiguous().view(torch.int32).long()
    return torch.where(b >= 0, b, -(b & _MAG))


def _from_key(k: Tensor) -> Tensor:
    b = torch.where(k >= 0, k, (-k) | _SIGN)
    b = torch.where(b >= 2**31, b - 2**32, b)  # back into int32 range
    return b.to(torch.int32).view(torch.float32)


class StepFunction:
    def __init__(self, thresholds: Tensor, levels: Tensor) -> None:
        self.thresholds = thresholds.contiguous()
        self.levels = levels.contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        return self.levels.take(torch.bucketize(x.contiguous(), self.thresholds, right=True))

    def to(self, device: torch.device | str) -> "StepFunction":
        return StepFunction(self.thresholds.to(device), self.levels.to(device))

    @classmethod
    def build(cls, q: Quantizer, check: Tensor | None = None) -> "StepFunction | None":
        """The step function of ``q`` (calibrated, per-tensor), or None if it cannot be exact."""
        if not q.calibrated or q.axis is not None or "block_size" in q.options or q.family not in STEP_FAMILIES:
            return None
        lv = q.levels()
        if lv.dim() != 1:
            return None
        lv = torch.unique(q.fake_quant(lv.float()))  # reachable levels, sorted
        if lv.numel() < 2 or not torch.isfinite(lv).all():
            return None
        lo, hi = _to_key(lv[:-1]), _to_key(lv[1:])  # boundary i lies in (lv[i], lv[i+1]]
        target = lv[1:]
        for _ in range(34):
            mid = (lo + hi) // 2
            ge = q.fake_quant(_from_key(mid)) >= target
            hi = torch.where(ge, mid, hi)
            lo = torch.where(ge, lo, mid)
            if bool((hi - lo <= 1).all()):
                break
        step = cls(_from_key(hi), lv)
        probe = torch.cat([lv, _from_key(hi), _from_key(hi - 1), _from_key(lo)])
        if check is not None:
            probe = torch.cat([probe, check.detach().float().flatten()[: 1 << 18]])
        if not torch.equal(step(probe), q.fake_quant(probe)):
            return None  # not a monotone step function: keep the direct path
        return step
