"""Block-wise reconstruction (I&S-ViT / DopQ-ViT style), optional and slow on CPU.

After calibration, each block's Linear weights are trained so that the quantized block,
fed the quantized model's own block input, reproduces the full-precision block output.
Quantizer scales stay fixed; rounding passes gradients straight through (STE), for weights
and for the block's activation quantizers. Adam, ``iters`` steps per block.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..capture import Cancelled

Progress = Callable[[int, int, str], None]


def _block_tensors(model: nn.Module, path: str, x: torch.Tensor | list[torch.Tensor], inputs: bool) -> list[torch.Tensor]:
    """Block ``path``'s input (or output) for each calibration batch."""
    seen: list[torch.Tensor] = []
    block = model.get_submodule(path)

    def grab(t: Any) -> None:
        seen.append((t[0] if isinstance(t, tuple) else t).detach())

    h = (block.register_forward_pre_hook(lambda m, a: grab(a)) if inputs
         else block.register_forward_hook(lambda m, a, o: grab(o)))
    try:
        with torch.no_grad():
            for b in x if isinstance(x, list) else [x]:
                model(b)
    finally:
        h.remove()
    return seen


def reconstruct(qm: Any, fp_model: nn.Module, calib: torch.Tensor | list[torch.Tensor], iters: int,
                lr: float = 1e-4, progress: Progress | None = None, cancel: Callable[[], bool] | None = None) -> list[str]:
    """Reconstruct every block in order; returns the Linear modules whose weights changed."""
    blocks = [s.module for s in qm.sites if s.kind == "residual"]
    changed: list[str] = []
    if progress:
        progress(0, len(blocks), "")
    for bi, path in enumerate(blocks):
        if cancel and cancel():
            raise Cancelled("reconstruction cancelled; nothing was written")
        linears = [p for p in qm.weights if p.startswith(path + ".")]
        if not linears:
            continue
        inputs = _block_tensors(qm.model, path, calib, inputs=True)
        targets = _block_tensors(fp_model, path, calib, inputs=False)
        block = qm.model.get_submodule(path)
        params = {p: qm.fp_weights[p].clone().requires_grad_(True) for p in linears}
        opt = torch.optim.Adam(params.values(), lr=lr)
        qm.ste = True
        try:
            with torch.enable_grad():
                for it in range(iters):
                    if cancel and cancel():  # every step: a block's steps can take minutes on a CPU
                        raise Cancelled("reconstruction cancelled; nothing was written")
                    k = it % len(inputs)
                    subs = {f"{p[len(path) + 1:]}.weight": w + (qm.weights[p].fake_quant(w) - w).detach()
                            for p, w in params.items()}
                    out = torch.func.functional_call(block, subs, (inputs[k],))
                    out = out[0] if isinstance(out, tuple) else out
                    loss = torch.nn.functional.mse_loss(out, targets[k])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        finally:
            qm.ste = False
        with torch.no_grad():
            for p, w in params.items():
                qm.fp_weights[p] = w.detach().clone()
                qm.model.get_submodule(p).weight.data.copy_(qm.weights[p].fake_quant(qm.fp_weights[p]))
        changed += linears
        if progress:
            progress(bi + 1, len(blocks), f"reconstructed {path} (loss {float(loss):.3g})")
    return changed
