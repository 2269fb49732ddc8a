"""A calibrated per-tensor quantizer turned into a monotone step function, bit-exact.

Inference then costs one table lookup per value, whatever the quantizer's formula (log2,
log√2, AdaLog, SULQ, TanQ, FP formats, uniform, twin): on CPU the compiled kernel of
:mod:`vizq.quant.native` (a bin table indexed by the float's top bits, then at most two
comparisons), elsewhere or without a compiler a binary search (``torch.bucketize``); both
give the same bits. The thresholds are found by bisection over float32 bit patterns on the
quantizer's own ``fake_quant``, so the step function returns exactly what ``fake_quant``
returns for every float; a quantizer that is not monotone (or not per-tensor) is refused and
keeps its direct path.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import native
from .base import Quantizer

Tensor = torch.Tensor
#: Families whose formulas (log/exp, format tables) are slower than a binary search; uniform
#: grids already have torch's fused one-pass kernel, which only the compiled kernel beats.
STEP_FAMILIES = ("log", "float")
_SIGN = 0x80000000
_MAG = 0x7FFFFFFF
_NEG_INF = 0xFF800000
#: The compiled kernel compares with this many thresholds after a bin's count (SCAN in
#: _native.c); a step function with more in one bin is left to torch.
MAX_SCAN = 2


def _to_key(f: Tensor) -> Tensor:
    """Order-preserving map float32 -> int64 (bit pattern, negatives mirrored)."""
    b = f.contiguous().view(torch.int32).long()
    return torch.where(b >= 0, b, -(b & _MAG))


def _from_key(k: Tensor) -> Tensor:
    return _bits_to_float(torch.where(k >= 0, k, (-k) | _SIGN))


def _bits_to_float(b: Tensor) -> Tensor:
    """float32 values of unsigned 32-bit patterns held in int64."""
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


#: Bin widths tried, coarsest first, for the smallest table (shift 22: 1024 bins of sign,
#: exponent and one mantissa bit; shift 16: 65536 bins with seven mantissa bits).
SHIFTS = (22, 20, 18, 16)


def bin_table(thresholds: Tensor) -> tuple[Tensor, int] | None:
    """The compiled kernel's table and shift: for each bin of float32 bit patterns (bits >> shift),
    how many thresholds lie at or below the bin's smallest value. The coarsest shift whose bins
    hold at most MAX_SCAN thresholds each is used; None if even the finest does not qualify.

    Positive bins grow with their low bits, negative ones shrink, so a bin's smallest value has
    low bits 0 (positive) or all ones (negative; -inf where the bin also holds NaN patterns).
    NaN inputs never reach the table (the kernel passes them through); ±inf are exact.
    """
    t = thresholds.detach().float().cpu().contiguous()
    if t.numel() >= 1 << 16:
        return None

    def count(bits: Tensor) -> Tensor:
        return torch.bucketize(_bits_to_float(bits), t, right=True)

    for shift in SHIFTS:
        top = torch.arange(1 << (32 - shift), dtype=torch.int64) << shift
        low = (1 << shift) - 1
        neg = top >= _SIGN
        neg_lo = torch.where(top <= _NEG_INF, (top | low).clamp_max(_NEG_INF), top | low)  # -inf, not NaN
        lo = count(torch.where(neg, neg_lo, top))
        hi = count(torch.where(neg, top, top | low))
        if int((hi - lo).max()) <= MAX_SCAN:
            return lo.to(torch.uint16), shift
    return None


class StepFunction:
    def __init__(self, thresholds: Tensor, levels: Tensor) -> None:
        self.thresholds = thresholds.float().contiguous()
        self.levels = levels.float().contiguous()
        binned = bin_table(self.thresholds) if self.thresholds.device.type == "cpu" else None
        self.table, self.shift = binned if binned is not None else (None, 0)
        # the kernel reads up to MAX_SCAN thresholds past a bin's count: pad with NaN (never <=)
        self.padded = torch.cat([self.thresholds, self.thresholds.new_full((MAX_SCAN,), float("nan"))])

    @property
    def native(self) -> bool:
        """Whether calls on CPU float32 tensors run the compiled kernel."""
        return self.table is not None and native.available()

    def __call__(self, x: Tensor) -> Tensor:
        if self.table is not None:
            out = native.step_apply(x, self)
            if out is not None:
                return out
        return self.reference(x)

    def reference(self, x: Tensor) -> Tensor:
        """The torch-only evaluation (binary search); same bits as the kernel, NaN kept as NaN."""
        out = self.levels.take(torch.bucketize(x.contiguous(), self.thresholds, right=True))
        nan = torch.isnan(x)
        return out.masked_fill(nan, float("nan")) if bool(nan.any()) else out

    def to(self, device: torch.device | str) -> "StepFunction":
        return StepFunction(self.thresholds.to(device), self.levels.to(device))

    @classmethod
    def build(cls, q: Quantizer, check: Tensor | None = None) -> "StepFunction | None":
        """The step function of ``q`` (calibrated, per-tensor), or None if it cannot be exact."""
        if not q.calibrated or q.axis is not None or "block_size" in q.options:
            return None
        lv = q.levels()
        if lv.dim() != 1:
            return None
        # levels() lists the grid; what fake_quant reaches can differ at the clamps (a fractional
        # zero point, as RepQ-ViT's folded quantizers have: (clamp(round(x/s) + z) - z)·s puts the
        # top level at (qmax - z)·s, off the r·s grid): probe between and beyond the levels too
        span = (lv[-1] - lv[0]).abs().clamp_min(1.0)
        mids = (lv[1:] + lv[:-1]) / 2
        cands = torch.cat([lv, mids, torch.stack([lv[0] - span, lv[-1] + span])])
        return cls.fit(q.fake_quant, cands, check)

    @classmethod
    def fit(cls, f: Callable[[Tensor], Tensor], candidates: Tensor, check: Tensor | None = None) -> "StepFunction | None":
        """The step function equal to ``f`` (monotone, onto the values ``f(candidates)``), found by
        bisection on float32 bit patterns and verified; None if ``f`` is not such a function."""
        c = torch.unique(candidates.float())  # sorted
        fc = f(c)
        lv = torch.unique(fc)  # reachable levels, sorted
        if lv.numel() < 2 or not torch.isfinite(lv).all() or not bool((fc[1:] >= fc[:-1]).all()):
            return None
        # boundary i (where f first reaches lv[i+1]) lies between the last candidate below that
        # level and the first at or above it; usually (lv[i], lv[i+1]], but not at the clamps
        # of a fractional zero point, where a level is not its own preimage
        at = torch.searchsorted(fc, lv[1:])
        lo, hi = _to_key(c[at - 1]), _to_key(c[at])
        target = lv[1:]
        for _ in range(34):
            mid = (lo + hi) // 2
            ge = f(_from_key(mid)) >= target
            hi = torch.where(ge, mid, hi)
            lo = torch.where(ge, lo, mid)
            if bool((hi - lo <= 1).all()):
                break
        step = cls(_from_key(hi), lv)
        far = torch.stack([candidates.min() * 4 - 1, candidates.max() * 4 + 1]).float()
        probe = torch.cat([lv, _from_key(hi), _from_key(hi - 1), _from_key(lo), candidates.float(), far])
        if check is not None:
            probe = torch.cat([probe, check.detach().float().flatten()[: 1 << 18]])
        if not torch.equal(step.reference(probe), f(probe)):
            return None  # not a monotone step function: keep the direct path
        return step
