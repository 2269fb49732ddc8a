"""Uniform (integer) quantizers: asymmetric and symmetric, four ways to pick the clip range.

``method``: ``minmax`` (the naive baseline), ``percentile`` (RepQ-ViT: the 0.999 / 0.9999 /
0.99999 quantile pair with the lowest MSE), ``mse`` (one clip ratio for both ends, grid
search), ``omse`` (independent lower and upper clip ratios, 2-D grid search).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import Quantizer, Tensor, grid_search, subsample
from .registry import register

PERCENTILES = (0.999, 0.9999, 0.99999)
MSE_RATIOS = torch.linspace(0.2, 1.0, 41)
OMSE_RATIOS = torch.linspace(0.3, 1.0, 15)
EPS = 1e-8


def uniform_asym(x: Tensor, s: Tensor, z: Tensor, qmax: int) -> Tensor:
    """Asymmetric fake-quant: (clamp(round(x/s) + z, 0, qmax) - z) * s."""
    return (torch.clamp(torch.round(x / s) + z, 0, qmax) - z) * s


def uniform_sym(x: Tensor, s: Tensor, qmin: int, qmax: int) -> Tensor:
    return torch.clamp(torch.round(x / s), qmin, qmax) * s


def asym_params(lo: Tensor, hi: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """Scale and integer zero point for the range [lo, hi] (the reference formula)."""
    s = ((hi - lo) / qmax).clamp_min(EPS)
    z = torch.round(-lo / s)
    return s, z


def quantile_pairs(g: Tensor, probs: tuple[float, ...]) -> tuple[Tensor, Tensor]:
    """[K, G] lower (1-p) and upper (p) quantiles of each group, via one sort."""
    x = subsample(g, 1 << 18).sort(dim=1).values
    m = x.shape[1] - 1
    hi_idx = torch.tensor([round(p * m) for p in probs], device=x.device)
    lo_idx = m - hi_idx
    return x[:, lo_idx].T, x[:, hi_idx].T


class _UniformBase(Quantizer):
    family: ClassVar[str] = "uniform"
    bit_range = (2, 16)
    defaults = {"granularity": "tensor", "method": "minmax"}
    choices = {"method": ("minmax", "percentile", "mse", "omse")}

    def _range_candidates(self, g: Tensor) -> tuple[Tensor, Tensor]:
        """[K, G] candidate (lo, hi) pairs for the chosen method."""
        lo, hi = g.min(1).values, g.max(1).values
        method = self.options["method"]
        if method == "minmax":
            return lo[None], hi[None]
        if method == "percentile":
            return quantile_pairs(g, PERCENTILES)
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
        best = grid_search(g, {"scale": s, "zero_point": z}, lambda x, p: uniform_asym(x, p["scale"], p["zero_point"], self.qmax))
        return best

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        fused = self._fused(x, p)
        return fused if fused is not None else uniform_asym(x, p["scale"], p["zero_point"], self.qmax)

    def _fused(self, x: Tensor, p: dict[str, Tensor]) -> Tensor | None:
        """torch's one-pass fake-quant kernel, where it computes the same thing (per-tensor or
        last-dim per-channel, zero points inside the code range, float32)."""
        s, z = p["scale"], p["zero_point"]
        if x.dtype != torch.float32 or self.bits > 16 or s.dim() > 1:
            return None
        x = x.contiguous()  # q/k/v are strided views of the qkv output: one copy beats the slow path
        zi = z.reshape(-1)
        if bool((zi < 0).any() or (zi > self.qmax).any()):
            return None
        if s.dim() == 0:
            return torch.fake_quantize_per_tensor_affine(x, s.float(), z.to(torch.int32), 0, self.qmax)
        if self.axis == -1 and s.numel() == x.shape[-1]:
            return torch.fake_quantize_per_channel_affine(x, s.float(), z.to(torch.int32), x.dim() - 1, 0, self.qmax)
        return None

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
        s = (torch.maximum(lo.abs(), hi.abs()) / qmax).clamp_min(EPS)
        if s.shape[0] == 1:
            return {"scale": s[0]}
        return grid_search(g, {"scale": s}, lambda x, p: uniform_sym(x, p["scale"], qmin, qmax))

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        return uniform_sym(x, p["scale"], *self.qrange)

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        qmin, qmax = self.qrange
        codes = torch.arange(qmin, qmax + 1, dtype=torch.float32, device=p["scale"].device)
        return codes[None] * p["scale"][:, None]
