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


#: |min GELU| = 0.16997...: the negative lobe's extent, in the released PTQ4ViT code's digits.
GELU_MIN = 0.16997124254703522
#: The released code's candidate fractions of the min/max step: 0.01 + 1.19·i/100, i = 0..99.
STEP_FRACTIONS = tuple(0.01 + i * (1.2 - 0.01) / 100 for i in range(100))


@register
class SplitSoftmaxQuantizer(Quantizer):
    """PTQ4ViT's softmax quantizer as its released code computes it ("split of softmax").

    Two uniform grids of 2^(b-1) codes each: a fine one of step split/(2^(b-1)-1) on [0, split]
    and a coarse one of step 1/(2^(b-1)-1) on [split, 1], the split searched among 2^-i,
    i = 0..19. The code *adds* the two parts, so every value above the split comes out ``split``
    higher than the coarse grid alone would put it, and with split ≥ 1/(2^b - 2) the values
    below it are lifted too; vizq keeps that, since it is what the published numbers were
    measured with (``twin``'s softmax mode is the paper's description instead).
    """

    name = "ptq4vit_softmax"
    family: ClassVar[str] = "uniform"
    description = "PTQ4ViT's released softmax quantizer: fine + coarse uniform grid, split searched"
    bit_range = (2, 8)
    defaults = {"granularity": "tensor"}
    choices = {"granularity": ("tensor",)}

    @property
    def top(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def _fit(self, g: Tensor) -> dict[str, Tensor]:
        splits = torch.tensor([2.0**-i for i in range(20)], device=g.device)[:, None].expand(-1, g.shape[0])
        return grid_search(g, {"split": splits.contiguous()}, self._apply, score=self._score)

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        split, top = p["split"], self.top
        step = split / top
        high = (torch.maximum(x, split).clamp(max=1.0) * top).round_().clamp_(0, top) / top
        low = (x.clamp(min=0.0).minimum(split) / step).round_().clamp_(0, top) * step
        return high + low

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        """Every output the formula can give: it is piecewise constant, so one input per step
        (the fine grid's points, the coarse grid's points above the split, the split) finds them."""
        out = []
        for split in p["split"].tolist():
            s = torch.tensor(split)
            pts = torch.cat([torch.arange(self.top + 1) * (s / self.top), torch.arange(self.top + 1) / self.top, s[None]])
            pts = pts[(pts >= 0) & (pts <= 1)]
            out.append(torch.unique(self._apply(pts, {"split": s})))
        return torch.nn.utils.rnn.pad_sequence(out, batch_first=True, padding_value=float("nan"))


@register
class GeluTwinQuantizer(Quantizer):
    """PTQ4ViT's post-GELU quantizer as its released code computes it: the sign picks one of two
    uniform grids, 2^(b-1) codes of a searched step for x ≥ 0 and 2^(b-1) + 1 codes of the fixed
    step |min GELU|/2^(b-1) for the negative lobe (down to exactly -0.16997)."""

    name = "ptq4vit_gelu"
    family: ClassVar[str] = "uniform"
    description = "PTQ4ViT's released post-GELU quantizer: searched positive step, fixed negative step"
    bit_range = (2, 8)
    defaults = {"granularity": "tensor"}
    choices = {"granularity": ("tensor", "channel", "token")}

    @property
    def half(self) -> int:
        return 2 ** (self.bits - 1)

    def neg_step(self, device: torch.device | str = "cpu") -> Tensor:
        return torch.tensor(GELU_MIN / self.half, dtype=torch.float32, device=device)

    def _fit(self, g: Tensor) -> dict[str, Tensor]:
        base = g.max(1).values.clamp_min(torch.finfo(torch.float32).tiny) / (self.half - 0.5)
        steps = torch.tensor(STEP_FRACTIONS, device=g.device)[:, None] * base[None]
        neg = self.neg_step(g.device).expand_as(steps)
        return grid_search(g, {"scale": steps.contiguous(), "neg_scale": neg.contiguous()}, self._apply,
                           score=self._score)

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        s, sn, h = p["scale"], p["neg_scale"], self.half
        return torch.div(x, s).round_().clamp_(0, h - 1).mul_(s) + torch.div(x, sn).round_().clamp_(-h, 0).mul_(sn)

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        h = self.half
        neg = torch.arange(-h, 0, dtype=torch.float32)[None] * p["neg_scale"][:, None]
        pos = torch.arange(h, dtype=torch.float32)[None] * p["scale"][:, None]
        return torch.cat([neg, pos], 1)
