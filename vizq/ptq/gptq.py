"""GPTQ-style weight error compensation: round a Linear's weight one input column at a time and
push each column's rounding error onto the columns not yet rounded, weighted by the inverse
Gram matrix of the layer's calibration inputs (Frantar et al., ICLR'23, after OBQ).

Why it is here: on the real ViT-Ti at W4A4 the 4-bit weights are what the other quantizers'
errors compound with (README: keeping only the weights in float recovers 16 points, any
activation kind at most 8.5), and nearest rounding treats every weight alone. Compensation
minimises the layer's *output* error ‖X·Wᵀ − X·Ŵᵀ‖² in closed form: no training, no
gradients, seconds per model, so it is a calibration option (``QuantConfig.gptq``), not a
reconstruction.

The weight quantizer's grid (its per-row scale and zero point, calibrated as the preset says)
is kept; only which level each weight rounds to changes. The compensated float weight is what
vizq stores as the layer's float weight: its nearest rounding on that grid *is* the GPTQ
result, so exports reload it bit for bit with the ordinary fake-quant.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from ..quant import Quantizer
from .config import GPTQ_DAMP
from .reach import call_of

Tensor = torch.Tensor
#: λ = DAMP · mean(diag XᵀX) by default (QuantConfig.gptq_damp): keeps the inverse finite where
#: inputs are nearly collinear
DAMP = GPTQ_DAMP
#: weight quantizers whose grid is elementwise with per-row (or one) parameters: a column can be
#: rounded alone on it. Block formats (MX/NV) share a scale across columns; FP grids are left as they are.
GRIDS = ("uniform", "uniform_sym")
#: the row ranges GPTQ rounds on are searched over the clipping ratios of this method, each scored
#: by the layer's output error on the same inputs (:func:`output_score`): the percentile candidates
#: of a 192-value row are its min and max, too wide a grid at 4 bits
RANGE_METHOD = "mse"
#: GPTAQ's weight on its asymmetric term (``QuantConfig.gptaq``): the constant of the released
#: ViT code (Intelligent-Computing-Lab-Yale/GPTAQ, vit_quant/gptaq_utils.py)
ALPHA = 0.25


def supports(q: Quantizer) -> bool:
    return q.name in GRIDS and q.granularity.value in ("tensor", "out_channel")


def output_score(gram: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """Range candidates scored by the output error they cause, ΔW·XᵀX·ΔWᵀ per row (the Gram
    normalised by its mean diagonal so the sums stay in float32's range)."""
    h = (gram / gram.diagonal().mean().clamp_min(1e-30)).float()

    def score(wq: Tensor, w: Tensor) -> Tensor:  # [K, G, M] candidates against [G, M] groups -> [K, G]
        k, g = wq.shape[:2]
        d = (wq - w).reshape(k, -1, h.shape[0])  # weight rows (a per-tensor group holds all of them)
        return (d @ h).mul_(d).sum(-1).reshape(k, g, -1).sum(-1)

    return score


@torch.no_grad()
def input_grams(model: nn.Module, paths: Iterable[str], run: Callable[[], object]) -> dict[str, Tensor]:
    """XᵀX (float64, [in, in]) of each Linear's input over whatever ``run()`` feeds the model.

    The hooks read the input each Linear actually receives, so quantization hooks registered
    before them (vizq's site hooks) have already acted: the Gram is of the inputs the layer
    sees at this point of calibration."""
    grams: dict[str, Tensor] = {}
    handles = []
    for path in paths:
        mod = model.get_submodule(path)
        if not isinstance(mod, nn.Linear):
            continue  # the patch-embedding convolution keeps nearest rounding

        def hook(m: nn.Module, args: tuple, path: str = path) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            g = x.T @ x
            grams[path] = grams[path] + g if path in grams else g

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return grams


@torch.no_grad()
def compensate(weight: Tensor, gram: Tensor, q: Quantizer, damp: float = DAMP, act_order: bool = False,
               cross: Tensor | None = None, alpha: float = ALPHA) -> Tensor:
    """The float weight whose nearest rounding by ``q`` (already calibrated) is GPTQ's choice.

    Columns are rounded in their natural order, or with ``act_order`` (GPTQ's option of that
    name, ``QuantConfig.gptq_act_order``) in order of decreasing input energy, the diagonal of
    XᵀX: the inputs that move the output most are rounded while every other column can still
    absorb their error, and the least important ones, rounded last, absorb none (README: its
    measured effect on the real ViT-Ti). Column i of that order is rounded on q's grid; its
    error e_i, divided by U[i, i], is taken off the later columns along row i of U, the upper
    Cholesky factor of (XᵀX + λI)⁻¹. Inputs that never vary (a zero diagonal) get a unit
    diagonal, so their columns just round to nearest.

    With ``cross`` = (X − X̃)ᵀX̃ (GPTAQ, ``QuantConfig.gptaq``; ``gram`` is then X̃ᵀX̃ of the
    inputs the quantized network feeds the layer, X̃, and X those of the float network), the
    target is the float layer's output on the float inputs, ‖X·Wᵀ − X̃·Ŵᵀ‖², not on the
    quantized ones: upstream errors are compensated too. Each column's current value w_i also
    moves the later columns by α·w_i·P[i], with P = triu((X − X̃)ᵀX̃·Uᵀ, 1)·U — the released
    code's update, α its constant."""
    n = weight.shape[1]
    order = torch.argsort(gram.diagonal(), descending=True, stable=True) if act_order else torch.arange(n)
    w = weight.detach().float()[:, order].clone()
    h = gram.double()[order][:, order].clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    u64 = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    p = None
    if cross is not None:
        d = cross.double()[order][:, order].clone()
        d[:, dead] = 0.0  # an input that is always 0 in the quantized network carries no correction
        p = (alpha * (d @ u64.T).triu(diagonal=1) @ u64).float()
    u = u64.float()
    for i in range(n):
        col = w[:, i : i + 1]
        err = (col - q.fake_quant(col)) / u[i, i]
        if i + 1 < n:
            step = err @ u[i : i + 1, i + 1 :]
            if p is not None:
                step -= col @ p[i : i + 1, i + 1 :]
            w[:, i + 1 :].sub_(step)
    return w[:, torch.argsort(order)].to(weight.dtype)


def input_of(model: nn.Module, path: str, *args, **kwargs) -> Tensor:
    """The input ``path`` receives ([tokens, in], float64) when ``model`` runs on ``args``; the
    forward stops there, so the later layers cost nothing."""
    x = call_of(model, path, *args, **kwargs)[0][0]
    return x.detach().reshape(-1, x.shape[-1]).double()
