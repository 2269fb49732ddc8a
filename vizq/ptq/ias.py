"""I&S-ViT's calibration as its released code runs it (zysxmu/IaS-ViT, ``test_quant.py``).

The paper calls it a three-stage smooth optimisation (SOS); the code does this, and so does
this module, op for op where the numbers depend on it:

1. every activation quantizer is calibrated in one forward pass with the weights still float
   (RepQ-ViT's 0.999/0.9999/0.99999-quantile searches; ``qkv``/``fc1`` inputs per channel,
   the softmax with the code's SULQ, ``sulq_released``);
2. each reconstruction unit in network order (the patch embedding, every block, the head) has
   its float weights *and biases* trained with Adam (lr 4e-5, cosine to 0) so that, fed the
   float network's input with its activations quantized, it gives the float network's output;
   the loss is the squared error summed over tokens, averaged over the rest (the code's
   ``lp_loss``); activation rounding passes gradients straight through inside the clamp range
   and none outside (the code's ``round_ste`` under ``clamp``); LayerNorms and every quantizer
   parameter stay frozen; 64 samples a step, drawn with ``randperm`` (all of them, reordered,
   when there are fewer);
3. the per-channel post-LN ranges are folded into the LayerNorms (mean scale, unrounded mean
   zero point), the weight rows are searched over nine quantiles (``percentile_wide``) on the
   trained, folded weights, and the units are trained again, now fed the *quantized* network's
   input and with the weights rounded straight-through.

Why a module of its own and not ``recon.py``: that is AdaRound (each weight held to its two
neighbouring levels), which is what vizq's own presets use; this is free training of the float
weights, which the released code does and which overfits 32 calibration images on ViT-Ti
(``recon.py``'s docstring). A preset named after the code has to do what the code does.

The minibatch draws come from one generator seeded with the calibration seed and shared by all
units of both stages, as the code's global ``randperm`` stream is; so a wrapper that seeds the
code's global generator with the same seed before its first unit draws the same batches
(README: how the two were checked side by side).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..capture import Cancelled
from ..quant.logq import sulq_released
from .recon import _block_tensors

Progress = Callable[[int, int, str], None]

LR = 4e-5  # the code's block/layer reconstruction learning rate
BATCH = 64  # the code's reconstruction batch (``batch_size=64`` in test_quant.py)
ITERS = 1000  # the code's default steps, "a3w3/a4w4 setting is 1000"
ITERS_W6A6 = 200  # "a6w6 setting is 200" (the code's README)
REPORT_EVERY = 10


def default_iters(config: Any) -> int:
    """The steps a unit trains in each stage: the config's ``ias_iters``, else the code's."""
    if config.ias_iters:
        return config.ias_iters
    return ITERS_W6A6 if (config.wbits, config.abits) == (6, 6) else ITERS


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """The code's straight-through rounding; its value is round(x) exactly (Sterbenz)."""
    return (x.round() - x).detach() + x


def uniform_ste(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int) -> torch.Tensor:
    """The code's ``UniformQuantizer.forward``: the same ops in the same order, so value and
    gradient are the code's to the bit; the clamp stops the gradient outside the grid."""
    x_int = _round_ste(x / scale) + zero
    return (torch.clamp(x_int, 0, qmax) - zero) * scale


def _act_function(q: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A differentiable form of a calibrated activation quantizer, for the quantizers this
    preset uses; None for others (an override), which then pass gradients straight through."""
    if q.name == "uniform":
        return lambda x: uniform_ste(x, q._view(q.state["scale"], x), q._view(q.state["zero_point"], x), q.qmax)
    if q.name == "sulq_released" and not q.options["signed"]:
        return lambda x: sulq_released(x, q._view(q.state["shift"], x), q._view(q.state["lo"], x),
                                       q._view(q.state["hi"], x), q.n_codes, round_=_round_ste)
    return None


def units(qm: Any) -> list[str]:
    """What the code reconstructs, in network order: every block, and every quantized-weight
    module outside the blocks on its own (patch embedding, head; Swin's patch merging)."""
    blocks = [s.module for s in qm.sites if s.kind == "residual"]
    alone = [p for p in qm.weights if not any(p.startswith(b + ".") for b in blocks)]
    order = {name: i for i, (name, _) in enumerate(qm.model.named_modules())}
    return sorted(dict.fromkeys(blocks + alone), key=order.__getitem__)


def _weights_in(qm: Any, unit: str) -> list[str]:
    return [p for p in qm.weights if p == unit or p.startswith(unit + ".")]


def _active_sites(qm: Any, unit: str) -> list[str]:
    """Quantized activation sites inside ``unit`` (a consumers-port site counts where a consumer is)."""
    inside = lambda m: m == unit or m.startswith(unit + ".")  # noqa: E731
    return [s.name for s in qm.sites if s.name in qm.acts
            and (inside(s.module) or any(inside(c) for c in s.consumers or ()))]


def _train(qm: Any, unit: str, inputs: torch.Tensor, targets: torch.Tensor, iters: int, quant_weights: bool,
           gen: torch.Generator, tick: Callable[[int], None]) -> None:
    """One unit's Adam training (the code's ``block_reconstruction`` / ``layer_reconstruction``)."""
    module = qm.model.get_submodule(unit)
    rel = lambda p: p[len(unit) + 1:] if p != unit else ""  # noqa: E731
    join = lambda p, leaf: f"{rel(p)}.{leaf}" if rel(p) else leaf  # noqa: E731
    params: dict[str, nn.Parameter] = {}
    for p in _weights_in(qm, unit):
        mod = qm.model.get_submodule(p)
        params[join(p, "weight")] = nn.Parameter(qm.fp_weights[p].clone())
        if getattr(mod, "bias", None) is not None:
            params[join(p, "bias")] = nn.Parameter(mod.bias.detach().clone())
    # the code's optimizer walks block.parameters(): the same tensors (the order changes nothing in Adam)
    order = [n for n, _ in module.named_parameters()]
    opt = torch.optim.Adam([params[n] for n in order if n in params], lr=LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iters, eta_min=0.0)
    grids = {}
    if quant_weights:
        for p in _weights_in(qm, unit):
            q = qm.weights[p]
            w = qm.fp_weights[p]
            grids[join(p, "weight")] = (q._view(q.state["scale"], w), q._view(q.state["zero_point"], w), q.qmax)
    qm.trainable = {name: f for name in qm.acts if (f := _act_function(qm.acts[name].q)) is not None}
    qm.ste, qm.drop = True, 0.0
    batch = min(BATCH, len(inputs))
    try:
        with torch.enable_grad():
            for it in range(iters):
                tick(it)
                idx = torch.randperm(inputs.shape[0], generator=gen)[:batch]
                x, y = inputs[idx], targets[idx]
                opt.zero_grad()
                subs = {n: (uniform_ste(t, *grids[n]) if n in grids else t) for n, t in params.items()}
                out = torch.func.functional_call(module, subs, (x,))
                out = out[0] if isinstance(out, tuple) else out
                loss = (out - y).abs().pow(2.0).sum(1).mean()  # the code's lp_loss(pred, tgt, p=2)
                loss.backward()
                opt.step()
                sched.step()
    finally:
        qm.ste, qm.trainable = False, {}
    with torch.no_grad():
        for p in _weights_in(qm, unit):
            mod = qm.model.get_submodule(p)
            w = params[join(p, "weight")].detach()
            qm.fp_weights[p] = w.clone()
            mod.weight.data.copy_(qm.weights[p].fake_quant(w) if quant_weights else w)
            if join(p, "bias") in params:
                mod.bias.data.copy_(params[join(p, "bias")].detach())


def calibrate(qm: Any, images: torch.Tensor | list[torch.Tensor], progress: Progress | None = None,
              cancel: Callable[[], bool] | None = None, only: list[str] | None = None) -> list[str]:
    """The whole procedure on ``qm`` (its weights still float); returns the modules whose
    weights it trained. ``only``: reconstruct just these units (the others keep their float
    weights in stage 2 and their nearest rounding in stage 3), for side-by-side checks."""
    x = torch.cat(images) if isinstance(images, list) else images
    iters = default_iters(qm.config)
    todo = [u for u in units(qm) if only is None or u in only]
    # a stage-1 unit with nothing quantized inside trains nothing (see below) and takes no time:
    # its steps are left out of the count, or the ETA would be measured on steps that cost nothing
    skip = {u for u in todo if not _active_sites(qm, u)}
    plan = [(stage, u) for stage in (1, 3) for u in todo if not (stage == 1 and u in skip)]
    total = iters * len(plan)
    gen = torch.Generator().manual_seed(qm.config.calibration.seed)
    fp_model = qm._fp[0]
    if progress:
        progress(0, total, "activation ranges (weights float)")
    for aq in qm.acts.values():
        aq.q.state = {}
        aq._last = (None, None)
    with torch.no_grad():  # stage 0: every activation range, network order, weights float
        qm.model(x)
    trained: list[str] = []
    for stage in (1, 3):
        if stage == 3:
            qm._reparameterize("mean")  # stage 2, the code's fold (RepQ-ViT's)
            qm._quantize_weights()
        for unit in todo:
            base = plan.index((stage, unit)) * iters if (stage, unit) in plan else 0

            def tick(it: int, base: int = base, unit: str = unit, stage: int = stage) -> None:
                if cancel and cancel():
                    raise Cancelled("calibration cancelled; nothing was written")
                if progress and it % REPORT_EVERY == 0:
                    progress(base + it, total, f"stage {stage}: {unit}")

            source = fp_model if stage == 1 else qm.model  # stage 1: float inputs; stage 3: quantized
            inputs = _block_tensors(source, unit, x, inputs=True)[0]
            targets = _block_tensors(fp_model, unit, x, inputs=False)[0]
            if stage == 1 and unit in skip:
                # nothing is quantized inside (the patch embedding: input float, weights not yet):
                # the loss is exactly 0, every gradient 0 and Adam's step 0, so training changes
                # nothing; only its minibatch draws are made, to keep the stream where the code's is
                for _ in range(iters):
                    torch.randperm(inputs.shape[0], generator=gen)
                continue
            _train(qm, unit, inputs, targets, iters, stage == 3, gen, tick)
            trained += [p for p in _weights_in(qm, unit) if p not in trained]
    if progress:
        progress(total, total, "ias-released done")
    return trained
