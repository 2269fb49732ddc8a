"""PTQ4ViT twin-uniform quantization: two uniform ranges, one bit says which.

``mode="softmax"``: a fine range [0, H·Δ1) for the many small probabilities and a coarse
range up to the max with Δ2 = Δ1·2^m (a shift in hardware). ``mode="gelu"``: the fine range
covers the small negative lobe, the coarse one the positive tail. ``auto`` picks gelu when the
calibration data has negatives. H = 2^(b-1) codes per range; Δ1 (or m) is searched by MSE.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import Quantizer, Tensor, grid_search
from .registry import register

SHIFTS = torch.arange(1, 13, dtype=torch.float32)
RATIOS = torch.linspace(0.4, 1.0, 13)


@register
class TwinUniformQuantizer(Quantizer):
    name = "twin"
    family: ClassVar[str] = "uniform"
    description = "twin uniform (PTQ4ViT): fine + coarse range"
    bit_range = (2, 8)
    defaults = {"granularity": "tensor", "mode": "auto"}
    choices = {"mode": ("auto", "softmax", "gelu")}

    @property
    def half(self) -> int:
        return 2 ** (self.bits - 1)

    def _fit(self, g: Tensor) -> dict[str, Tensor]:
        if self.options["mode"] == "auto":
            self.options["mode"] = "gelu" if bool((g < 0).any()) else "softmax"
        h = self.half
        dev = g.device
        if self.options["mode"] == "softmax":
            amax = g.max(1).values.clamp_min(1e-12)
            d2 = (amax / (h - 1))[None].expand(SHIFTS.numel(), -1)
            d1 = d2 / torch.exp2(SHIFTS.to(dev))[:, None]
            return grid_search(g, {"d1": d1.contiguous(), "d2": d2.contiguous()}, self._apply)
        # gelu: coarse positive range (clip ratio searched) and a fine negative range
        amax = g.max(1).values.clamp_min(1e-12)
        nmax = (-g.min(1).values).clamp_min(1e-12)
        r, m = torch.meshgrid(RATIOS.to(dev), SHIFTS[:6].to(dev) - 1, indexing="ij")
        d2 = r.reshape(-1, 1) * amax[None] / (h - 1)
        d1_fit = nmax[None] / (h - 1)  # fine range just covers the negative lobe ...
        d1 = torch.minimum(d2 / torch.exp2(m.reshape(-1, 1)), d2)  # ... as a power-of-two fraction of Δ2
        d1 = torch.maximum(d1, d1_fit / 64)
        # ... or exactly: without these candidates, data that is mostly or only negative (no
        # positive range to derive Δ1 from) was squeezed into a range 64× too small
        rr = RATIOS.to(dev)[:, None]
        d1 = torch.cat([d1, d1_fit.expand(rr.shape[0], -1)])
        d2 = torch.cat([d2, rr * amax[None] / (h - 1)])
        return grid_search(g, {"d1": d1.contiguous(), "d2": d2.contiguous()}, self._apply)

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        h = self.half
        d1, d2 = p["d1"], p["d2"]
        if self.options["mode"] == "softmax":
            fine = torch.clamp(torch.round(x / d1), 0, h - 1) * d1
            coarse = torch.clamp(torch.round(x / d2), 0, h - 1) * d2
            return torch.where(x < (h - 0.5) * d1, fine, coarse)
        neg = torch.clamp(torch.round(x / d1), -(h - 1), 0) * d1
        pos = torch.clamp(torch.round(x / d2), 0, h - 1) * d2
        return torch.where(x < 0, neg, pos)

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        h = self.half
        c = torch.arange(h, dtype=torch.float32, device=p["d1"].device)[None]
        d1, d2 = p["d1"][:, None], p["d2"][:, None]
        first = c * d1 if self.options["mode"] == "softmax" else -c * d1
        return torch.sort(torch.cat([first, c * d2], 1), 1).values
