"""Uniform (integer) quantizers: asymmetric and symmetric, four ways to pick the clip range.

``method``: ``minmax`` (the naive baseline), ``percentile`` (RepQ-ViT: the 0.999 / 0.9999 /
0.99999 quantile pair with the lowest MSE, exactly as its code does: ``torch.quantile`` of the
whole group, MSE over the whole group, first candidate wins ties), ``mse`` (one clip ratio for
both ends, grid search), ``omse`` (independent lower and upper clip ratios, 2-D grid search), ``percentile_wide`` (I&S-ViT's
released weight search: the same rule over nine quantiles from 0.97 to 0.99999).

Fake quantization is the reference formula ``(clamp(round(x / s) + z, 0, qmax) - z) * s``,
not torch's fused kernel (which multiplies by 1/s and so rounds a few values differently).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import Quantizer, Tensor, grid_search, quantiles
from .registry import register

PERCENTILES = (0.999, 0.9999, 0.99999)
#: I&S-ViT's released code searches weights over these (activations over PERCENTILES)
WIDE_PERCENTILES = (0.97, 0.98, 0.99, 0.995, 0.9995, 0.9997, 0.9999, 0.99995, 0.99999)
MSE_RATIOS = torch.linspace(0.2, 1.0, 41)
OMSE_RATIOS = torch.linspace(0.3, 1.0, 15)


def uniform_asym(x: Tensor, s: Tensor, z: Tensor, qmax: int) -> Tensor:
    """Asymmetric fake-quant: (clamp(round(x/s) + z, 0, qmax) - z) * s, the reference formula
    (in place after the first op: the same values, half the memory traffic in searches)."""
    q = torch.div(x, s)
    return q.round_().add_(z).clamp_(0, qmax).sub_(z).mul_(s)


def uniform_sym(x: Tensor, s: Tensor, qmin: int, qmax: int) -> Tensor:
    return torch.clamp(torch.round(x / s), qmin, qmax) * s


def min_scale(lo: Tensor, hi: Tensor) -> Tensor:
    """The smallest scale allowed for a range: relative to the data's magnitude (2^-23 of
    max |x|, float32's resolution there) rather than a fixed 1e-8, so tiny activations (1e-8)
    keep their levels, and a constant tensor reproduces itself; never below the smallest
    normal float32, so x / s stays finite."""
    mag = torch.maximum(lo.abs(), hi.abs())
    return (mag * 2.0**-23).clamp_min(torch.finfo(torch.float32).tiny)


def asym_params(lo: Tensor, hi: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """Scale and integer zero point for the range [lo, hi] (the reference formula)."""
    s = torch.maximum((hi - lo) / qmax, min_scale(lo, hi))
    z = torch.round(-lo / s)
    return s, z


def quantile_pairs(g: Tensor, probs: tuple[float, ...]) -> tuple[Tensor, Tensor]:
    """[K, G] lower (1 - p, computed as the reference does in float) and upper (p) quantiles."""
    q = quantiles(g, [*probs, *(1.0 - p for p in probs)])
    return q[len(probs):], q[: len(probs)]


_QUANTILE_SETS = {"percentile": PERCENTILES, "percentile_wide": WIDE_PERCENTILES}


class _UniformBase(Quantizer):
    family: ClassVar[str] = "uniform"
    bit_range = (2, 16)
    defaults = {"granularity": "tensor", "method": "minmax"}
    choices = {"method": ("minmax", "percentile", "percentile_wide", "mse", "omse")}

    def _range_candidates(self, g: Tensor) -> tuple[Tensor, Tensor]:
        """[K, G] candidate (lo, hi) pairs for the chosen method."""
        lo, hi = g.min(1).values, g.max(1).values
        method = self.options["method"]
        if method == "minmax":
            return lo[None], hi[None]
        if method in _QUANTILE_SETS:
            return quantile_pairs(g, _QUANTILE_SETS[method])
        if method == "mse":
            r = MSE_RATIOS.to(g.device)[:, None]
            return r * lo[None], r * hi[None]
        r = OMSE_RATIOS.to(g.device)
        rl, rh = torch.meshgrid(r, r, indexing="ij")
        return rl.reshape(-1, 1) * lo[None], rh.reshape(-1, 1) * hi[None]


@register
class UniformQuantizer(_UniformBase):
    """Asymmetric uniform: 2^b evenly spaced levels between a clipped min and max."""

    name = "uniform"
    description = "uniform asymmetric (min/max, percentile, MSE, OMSE)"

    @property
    def qmax(self) -> int:
        return 2**self.bits - 1

    def _fit(self, g: Tensor) -> dict[str, Tensor]:
        lo, hi = self._range_candidates(g)
        s, z = asym_params(lo, hi, self.qmax)
        if s.shape[0] == 1:
            return {"scale": s[0], "zero_point": z[0]}
        exact = self.options["method"] in _QUANTILE_SETS  # a few candidates: score them on everything
        return grid_search(g, {"scale": s, "zero_point": z},
                           lambda x, p: uniform_asym(x, p["scale"], p["zero_point"], self.qmax), score=self._score,
                           exact=exact)

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        return uniform_asym(x, p["scale"], p["zero_point"], self.qmax)

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        codes = torch.arange(self.qmax + 1, dtype=torch.float32, device=p["scale"].device)
        return (codes[None] - p["zero_point"][:, None]) * p["scale"][:, None]


@register
class SymmetricUniformQuantizer(_UniformBase):
    """Symmetric uniform: zero point fixed at 0, levels -2^(b-1)..2^(b-1)-1 times the scale."""

    name = "uniform_sym"
    description = "uniform symmetric (min/max, percentile, MSE, OMSE)"

    @property
    def qrange(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1

    def _fit(self, g: Tensor) -> dict[str, Tensor]:
        lo, hi = self._range_candidates(g)
        qmin, qmax = self.qrange
        s = torch.maximum(torch.maximum(lo.abs(), hi.abs()) / qmax, min_scale(lo, hi))
        if s.shape[0] == 1:
            return {"scale": s[0]}
        return grid_search(g, {"scale": s}, lambda x, p: uniform_sym(x, p["scale"], qmin, qmax), score=self._score,
                           exact=self.options["method"] in _QUANTILE_SETS)

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        return uniform_sym(x, p["scale"], *self.qrange)

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        qmin, qmax = self.qrange
        codes = torch.arange(qmin, qmax + 1, dtype=torch.float32, device=p["scale"].device)
        return codes[None] * p["scale"][:, None]
