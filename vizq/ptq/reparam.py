"""RepQ-ViT scale reparameterization: per-channel post-LN quantization folded into a
layer-wise one by moving the channel ratios into LayerNorm and the next Linear(s).

With per-channel (sᶜ, zᶜ) and the layer pair (s̃, z̃), r = sᶜ/s̃, δ = s̃·(z̃ − zᶜ):
  LN:     γ ← γ/r,  β ← β/r − δ
  Linear: W[:, c] ← W[:, c]·r_c,  b ← b + W_new·δ
In floating point the model output is unchanged. Modes:
- ``mean`` — RepQ-ViT's released code, to the bit: s̃ = mean(sᶜ), z̃ = mean(zᶜ) *unrounded*, all
  in float32 (``torch.mm`` for the bias). The folded per-tensor quantizer then only
  approximates the per-channel one (a fractional zero point shifts the grid).
- ``median`` — the same with s̃ = median(sᶜ) (DopQ-ViT's MOSF).
- ``mean_int`` — vizq's exact variant: z̃ = round(mean(zᶜ)) and the fold in float64, so
  quantizing the folded output per-tensor gives exactly the per-channel result.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InputError

Tensor = torch.Tensor
MODES = ("mean", "median", "mean_int")


@dataclass
class Fold:
    """What a fold did, for previews and exports (ratio and delta in the fold's dtype)."""

    ratio: Tensor  # r, [C]
    delta: Tensor  # δ, [C]
    scale: float  # s̃
    zero_point: float  # z̃


def layer_pair(scale: Tensor, zero_point: Tensor, mode: str = "mean") -> tuple[Tensor, Tensor]:
    """(s̃, z̃) from per-channel parameters (see the module docstring for the modes)."""
    if mode not in MODES:
        raise ValueError(f"reparam mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "mean_int":
        return scale.double().mean(), torch.round(zero_point.double().mean())
    st = scale.float().mean() if mode == "mean" else scale.float().median()
    return st, zero_point.float().mean()


def fold_factors(scale: Tensor, zero_point: Tensor, mode: str = "mean") -> Fold:
    st, zt = layer_pair(scale, zero_point, mode)
    if mode == "mean_int":
        r = scale.double() / st
        delta = st * (zt - zero_point.double())
    else:  # the reference's float32 arithmetic, in its order
        s, z = scale.float(), zero_point.float()
        r = s / st
        delta = (-z * s) / r - (-zt * st)
    return Fold(r, delta, float(st), float(zt))


@torch.no_grad()
def apply_fold(norm: nn.LayerNorm | None, consumers: list[nn.Linear], fold: Fold) -> None:
    """Fold in place (call it on a copy). Creates the consumer bias if it had none (Swin).

    ``norm=None`` folds only into the consumers: the caller then feeds them x/r − δ instead of
    x (post-LN blocks, whose LayerNorm output is also the residual stream).
    """
    r, d = fold.ratio, fold.delta
    dt = r.dtype  # float64 (exact mode) or float32 (the reference's arithmetic)
    if norm is not None:
        if norm.weight is None or norm.bias is None:
            raise InputError("reparameterization needs a LayerNorm with affine weight and bias")
        g, b = norm.weight.to(dt), norm.bias.to(dt)
        norm.weight.copy_((g / r).to(norm.weight.dtype))
        norm.bias.copy_((b / r - d).to(norm.bias.dtype))
    for lin in consumers:
        w = lin.weight.to(dt) * r[None, :]
        bias = lin.bias.to(dt) if lin.bias is not None else torch.zeros(w.shape[0], dtype=dt)
        bias = bias + torch.mm(w, d.to(dt).reshape(-1, 1)).reshape(-1)
        lin.weight.copy_(w.to(lin.weight.dtype))
        if lin.bias is None:
            lin.bias = nn.Parameter(bias.to(lin.weight.dtype), requires_grad=False)
        else:
            lin.bias.copy_(bias.to(lin.bias.dtype))


def preview_ranges(ch_min: Tensor, ch_max: Tensor, scale: Tensor, zero_point: Tensor, mode: str) -> dict[str, Tensor]:
    """Per-channel [min, max] of the LN output before and after folding (for the explorer)."""
    f = fold_factors(scale, zero_point, mode)
    return {
        "before_min": ch_min.double(),
        "before_max": ch_max.double(),
        "after_min": ch_min.double() / f.ratio - f.delta,
        "after_max": ch_max.double() / f.ratio - f.delta,
        "ratio": f.ratio,
    }
