"""RepQ-ViT scale reparameterization: per-channel post-LN quantization folded into a
layer-wise one, exactly, by moving the channel ratios into LayerNorm and the next Linear(s).

With per-channel (sᶜ, zᶜ) and the layer pair s̃ = mean(sᶜ) (median: DopQ-ViT's MOSF),
z̃ = round(mean(zᶜ)), r = sᶜ/s̃, δ = s̃·(z̃ − zᶜ):
  LN:     γ ← γ/r,  β ← β/r − δ
  Linear: W[:, c] ← W[:, c]·r_c,  b ← b + W_new·δ
In floating point the model output is unchanged; quantizing the new LN output per-tensor with
(s̃, z̃) gives exactly the per-channel result (integer zero points make it bit-exact).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InputError

Tensor = torch.Tensor


@dataclass
class Fold:
    """What a fold did, for previews and exports."""

    ratio: Tensor  # r, [C]
    delta: Tensor  # δ, [C]
    scale: float  # s̃
    zero_point: float  # z̃


def layer_pair(scale: Tensor, zero_point: Tensor, mode: str = "mean") -> tuple[Tensor, Tensor]:
    """(s̃, z̃) from per-channel parameters; ``mode`` is 'mean' (RepQ-ViT) or 'median' (DopQ-ViT)."""
    if mode not in ("mean", "median"):
        raise ValueError(f"reparam mode must be mean or median, got {mode!r}")
    s = scale.double()
    st = s.mean() if mode == "mean" else s.median()
    zt = torch.round(zero_point.double().mean())
    return st, zt


def fold_factors(scale: Tensor, zero_point: Tensor, mode: str = "mean") -> Fold:
    st, zt = layer_pair(scale, zero_point, mode)
    r = scale.double() / st
    delta = st * (zt - zero_point.double())
    return Fold(r, delta, float(st), float(zt))


@torch.no_grad()
def apply_fold(norm: nn.LayerNorm | None, consumers: list[nn.Linear], fold: Fold) -> None:
    """Fold in place (call it on a copy). Creates the consumer bias if it had none (Swin).

    ``norm=None`` folds only into the consumers: the caller then feeds them x/r − δ instead of
    x (post-LN blocks, whose LayerNorm output is also the residual stream).
    """
    r, d = fold.ratio, fold.delta
    if norm is not None:
        if norm.weight is None or norm.bias is None:
            raise InputError("reparameterization needs a LayerNorm with affine weight and bias")
        g, b = norm.weight.double(), norm.bias.double()
        norm.weight.copy_((g / r).to(norm.weight.dtype))
        norm.bias.copy_((b / r - d).to(norm.bias.dtype))
    for lin in consumers:
        w = lin.weight.double() * r[None, :]
        bias = lin.bias.double() if lin.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
        bias = bias + w @ d
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
