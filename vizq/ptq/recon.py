"""Block reconstruction: learned weight rounding per block (AdaRound, as BRECQ and QDrop use it).

After calibration, each block in turn gets its integer weights re-rounded: every weight may go
to the grid point below or above its float value (never further), and a continuous relaxation
of that choice is trained so that the quantized block, fed the quantized model's own block
input, reproduces the float block's output. Scales and zero points stay as calibrated, so the
result is still exactly the calibrated grid; activation quantizers pass gradients straight
through, and QDrop keeps half their values in float during the training.

Why this form and not free weight training: vizq's first reconstruction trained the float
weights themselves with a straight-through rounding. On 32 calibration images it overfitted and
made the real ViT-Ti worse at W4A4 (``ias``: 32.9 % → 7.3 % top-1). Restricting each weight to
its two neighbouring levels, with a regulariser that anneals the relaxation to a hard choice,
is what lets 32 images suffice (README: the measured effect).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..capture import Cancelled
from ..quant import Quantizer
from .config import ConfigError, ReconLoss
from .reach import call_of, output_of
from .views import augmented_views

Progress = Callable[[int, int, str], None]

#: AdaRound's stretched sigmoid: h(V) = clamp(σ(V)·(ζ − γ) + γ, 0, 1) reaches 0 and 1 exactly.
ZETA, GAMMA = 1.1, -0.1
#: Adam on the rounding variables (AdaRound/BRECQ's default). At a few hundred steps it lets only
#: near-ties change their rounding, which also keeps 32 images from overfitting them: 1e-2 freed a
#: quarter of the roundings and cost 12-16 points on ViT-Ti W4A4 (README, under the targets)
LR = 1e-3
REG_WEIGHT = 0.01  # rounding regulariser against the block's summed squared error (BRECQ's default)
WARMUP = 0.2  # the first fifth of the steps fits the output with no pull towards 0 or 1
BETA = (20.0, 2.0)  # the regulariser's exponent, annealed linearly after the warm-up
DROP = 0.5  # QDrop: fraction of activation values left unquantized while training
LR_SCALE = 1e-3  # Adam on log activation scales, cosine-annealed to 0 over a block's steps
REPORT_EVERY = 10  # progress line every this many steps


@dataclass(frozen=True)
class Grid:
    """One weight quantizer's integer grid: w_q = s · (clamp(k + z, lo, hi) − z), k an integer;
    ``scale`` and ``zero`` already broadcast against the weight (any grouping axis)."""

    scale: torch.Tensor
    zero: torch.Tensor
    lo: int
    hi: int


def _asym(q: Quantizer, w: torch.Tensor) -> Grid:
    return Grid(q._view(q.state["scale"], w), q._view(q.state["zero_point"], w), 0, q.qmax)


def _sym(q: Quantizer, w: torch.Tensor) -> Grid:
    lo, hi = q.qrange
    s = q._view(q.state["scale"], w)
    return Grid(s, torch.zeros_like(s), lo, hi)


#: Weight quantizers whose rounding can be learned, by name. Others (log, float and block
#: formats) keep their calibrated rounding; reconstruction reports them as skipped.
GRIDS: dict[str, Callable[[Quantizer, torch.Tensor], Grid]] = {"uniform": _asym, "uniform_sym": _sym}


class _LsqFakeQuant(torch.autograd.Function):
    """(clamp(round(x/s) + z, lo, hi) − z)·s with LSQ's gradients: straight through for x
    inside the grid's range (zero outside), and d/ds = (q − z) − x/s inside, (q − z) outside.
    One fused function instead of autograd's chain: it keeps one float and one bool tensor
    for the backward pass instead of five floats, which is most of a block step's cost here."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        xs = x / s
        code = torch.round(xs).add_(z)
        inside = (code >= lo) & (code <= hi)
        code.clamp_(lo, hi).sub_(z)  # the integer code relative to the zero point
        out = code * s
        ctx.save_for_backward(code.sub_(xs.mul_(inside)), inside, s)  # d out / d s
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        d_s, inside, s = ctx.saved_tensors
        gs = (g * d_s).sum_to_size(s.shape) if ctx.needs_input_grad[1] else None
        return g * inside, gs, None, None, None


class LearnedScale:
    """One uniform activation quantizer whose scale is learned during reconstruction (LSQ, as
    BRECQ and QDrop do): s = s₀·exp(t), t trained from 0, the integer zero point kept. Why a
    log parameter: one learning rate then suits scales from 1e-3 to 10 (ViT sites span that)."""

    def __init__(self, q: Quantizer) -> None:
        self.q = q
        self.s0 = q.state["scale"].detach()
        self.t = torch.zeros_like(self.s0, requires_grad=True)
        self.lo, self.hi = (0, q.qmax) if q.name == "uniform" else q.qrange
        self.z = q.state["zero_point"].detach() if q.name == "uniform" else torch.zeros_like(self.s0)

    def scale(self) -> torch.Tensor:
        return self.s0 * torch.exp(self.t)

    def __call__(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        xs = x + shift if shift else x
        s, z = self.q._view(self.scale(), xs), self.q._view(self.z, xs)
        out = _LsqFakeQuant.apply(xs, s, z, self.lo, self.hi)
        return out - shift if shift else out

    def commit(self) -> None:
        self.q.state["scale"] = self.scale().detach().float().contiguous()


#: Activation quantizers whose scale can be learned, by name (integer grids); others keep theirs.
ACT_SCALES = ("uniform", "uniform_sym")


class LearnedRounding:
    """One Linear's weight as floor(w/s) plus a learnable up-or-down choice per weight."""

    def __init__(self, grid: Grid, w: torch.Tensor) -> None:
        self.s, self.z = grid.scale.to(w), grid.zero.to(w)
        self.lo, self.hi = grid.lo, grid.hi
        scaled = w / self.s
        self.floor = torch.floor(scaled)
        rest = (scaled - self.floor).clamp(1e-4, 1 - 1e-4)
        # start where h(V) equals the fractional part: the soft weight is the float weight
        self.v = (-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)).requires_grad_(True)

    def h(self) -> torch.Tensor:
        return torch.clamp(torch.sigmoid(self.v) * (ZETA - GAMMA) + GAMMA, 0, 1)

    def weight(self, hard: bool = False) -> torch.Tensor:
        up = (self.v >= 0).to(self.s) if hard else self.h()
        return self.s * (torch.clamp(self.floor + up + self.z, self.lo, self.hi) - self.z)

    def regulariser(self, beta: float) -> torch.Tensor:
        return (1 - (2 * self.h() - 1).abs().pow(beta)).sum()


def _block_tensors(model: nn.Module, path: str, x: torch.Tensor | list[torch.Tensor], inputs: bool) -> list[torch.Tensor]:
    """Block ``path``'s input (or output) for each calibration batch; each forward stops at the block."""
    seen = []
    for b in x if isinstance(x, list) else [x]:
        t = call_of(model, path, b)[0][0] if inputs else output_of(model, path, b)
        seen.append((t[0] if isinstance(t, tuple) else t).detach())
    return seen


def _token_weights(target: torch.Tensor) -> torch.Tensor:
    """Per-token weights for ``ReconLoss.TOKEN``: the median token mean square over each token's
    own, from the float output. Dividing by a token's mean square is what the next LayerNorm
    does (up to the mean), so an error counts by how much it moves what the consumers see; the
    median keeps ordinary tokens' weights near 1, so the loss stays on the scale REG_WEIGHT
    was set for. Massive-activation tokens (mean square ~10⁴× the median) get weights ~10⁻⁴."""
    ms = target.detach().pow(2).mean(-1, keepdim=True).clamp_min(1e-12)
    return ms.median() / ms


def block_loss(out: torch.Tensor, target: torch.Tensor, kind: ReconLoss) -> torch.Tensor:
    """The reconstruction loss: squared error summed over each sample's values (per-token
    weighted for TOKEN), averaged over samples."""
    err = (out - target).pow(2)
    if kind is ReconLoss.TOKEN and err.dim() >= 3:  # [batch, tokens, channels]; others stay plain
        err = err * _token_weights(target)
    return err.flatten(1).sum(1).mean()


def _beta(it: int, iters: int) -> float | None:
    """The regulariser's exponent at step ``it``; None during the warm-up (no regulariser)."""
    start = WARMUP * iters
    if it < start:
        return None
    return BETA[0] + (BETA[1] - BETA[0]) * (it - start) / max(iters - start, 1)


def _minibatches(inputs: list[torch.Tensor], targets: list[torch.Tensor], batch: int,
                 gen: torch.Generator) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Step ``it``'s (input, target): the calibration batches in turn, or with ``batch`` a
    seeded random draw of that many samples (without replacement) from all of them."""
    if not batch or any(t.shape[1:] != inputs[0].shape[1:] for t in inputs):
        return lambda it: (inputs[it % len(inputs)], targets[it % len(inputs)])
    x, y = torch.cat(inputs), torch.cat(targets)
    if batch >= len(x):
        return lambda it: (x, y)

    def draw(it: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randperm(len(x), generator=gen)[:batch].to(x.device)
        return x[idx], y[idx]
    return draw


def _train_block(qm: Any, path: str, rounding: dict[str, LearnedRounding], scales: dict[str, LearnedScale],
                 inputs: list[torch.Tensor], targets: list[torch.Tensor], iters: int,
                 tick: Callable[[int], None], batch: int = 0, kind: ReconLoss = ReconLoss.MSE) -> None:
    block = qm.model.get_submodule(path)
    opt = torch.optim.Adam([r.v for r in rounding.values()], lr=LR)
    opt_s = torch.optim.Adam([ls.t for ls in scales.values()], lr=LR_SCALE) if scales else None
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt_s, T_max=iters, eta_min=0.0) if opt_s else None
    qm.ste, qm.drop = True, DROP
    qm.trainable = {name: (lambda x, ls=ls, sh=qm.acts[name].shift: ls(x, sh)) for name, ls in scales.items()}
    # the masks follow the calibration seed, so a run reproduces; its spread is the seed's (README)
    qm.drop_rng = torch.Generator(inputs[0].device).manual_seed(qm.config.calibration.seed)
    draw = _minibatches(inputs, targets, batch, torch.Generator().manual_seed(qm.config.calibration.seed))
    try:
        with torch.enable_grad():
            for it in range(iters):
                tick(it)
                x, target = draw(it)
                subs = {f"{p[len(path) + 1:]}.weight": r.weight() for p, r in rounding.items()}
                out = torch.func.functional_call(block, subs, (x,))
                out = out[0] if isinstance(out, tuple) else out
                loss = block_loss(out, target, kind)
                beta = _beta(it, iters)
                if beta is not None:
                    loss = loss + REG_WEIGHT * sum(r.regulariser(beta) for r in rounding.values())
                opt.zero_grad()
                if opt_s:
                    opt_s.zero_grad()
                loss.backward()
                opt.step()
                if opt_s:
                    opt_s.step()
                    sched.step()
    finally:
        qm.ste, qm.drop, qm.drop_rng, qm.trainable = False, 0.0, None, {}


def reconstruct(qm: Any, fp_model: nn.Module, calib: torch.Tensor | list[torch.Tensor], iters: int,
                progress: Progress | None = None, cancel: Callable[[], bool] | None = None,
                learn_scales: bool = False, batch: int = 0, loss: ReconLoss = ReconLoss.MSE,
                views: int = 1) -> list[str]:
    """Re-round every block's weights in network order; returns the Linear modules changed.
    With ``learn_scales`` the block's uniform activation scales are trained too (their new
    values are the calibrated state afterwards, so exports carry them); ``loss`` is what each
    block minimises (``ReconLoss``); ``views`` > 1 trains on that many seeded crops and flips of
    each calibration image (the image itself first; ptq/views.py).

    Progress counts steps over all blocks; cancelling stops at the next step and nothing of the
    calibration is kept by the caller."""
    blocks = [s.module for s in qm.sites if s.kind == "residual"]
    plan = {b: [p for p in qm.weights if p.startswith(b + ".") and qm.weights[p].name in GRIDS] for b in blocks}
    plan = {b: ps for b, ps in plan.items() if ps}
    total = iters * len(plan)
    if views > 1:
        if not isinstance(calib, torch.Tensor) or calib.dim() != 4:
            raise ConfigError("recon_views augments images: this model's calibration data are not one batch of images; "
                             "set recon_views to 1")
        calib = augmented_views(calib, views, qm.config.calibration.seed)
    changed: list[str] = []
    if progress:
        progress(0, total, "")
    for bi, (path, linears) in enumerate(plan.items()):
        def tick(it: int, base: int = bi * iters, path: str = path) -> None:
            if cancel and cancel():  # every step: a block's steps take a minute on a CPU
                raise Cancelled("reconstruction cancelled; nothing was written")
            if progress and it and it % REPORT_EVERY == 0:
                progress(base + it, total, path)

        tick(0)
        inputs = _block_tensors(qm.model, path, calib, inputs=True)
        targets = _block_tensors(fp_model, path, calib, inputs=False)
        rounding = {}
        for p in linears:
            q, w = qm.weights[p], qm.fp_weights[p]
            rounding[p] = LearnedRounding(GRIDS[q.name](q, w), w)
        scales = {}
        if learn_scales:
            scales = {s.name: LearnedScale(qm.acts[s.name].q) for s in qm.sites
                      if s.name in qm.acts and s.module.startswith(path + ".") and qm.acts[s.name].q.name in ACT_SCALES}
        _train_block(qm, path, rounding, scales, inputs, targets, iters, tick, batch, loss)
        for name, ls in scales.items():
            ls.commit()
            aq = qm.acts[name]
            aq.step, aq._last = None, (None, None)
            aq.compile()
        with torch.no_grad():
            for p, r in rounding.items():
                w = r.weight(hard=True)  # on the grid: the quantizer maps it to itself
                qm.fp_weights[p] = w
                qm.model.get_submodule(p).weight.data.copy_(qm.weights[p].fake_quant(w))
        changed += linears
        if progress:
            progress((bi + 1) * iters, total, f"{path} re-rounded")
    return changed
