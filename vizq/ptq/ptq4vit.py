"""PTQ4ViT's calibration, done the way its released code (hahnyuan/PTQ4ViT) does it.

The ``ptq4vit`` preset runs this instead of the sequential RepQ-ViT-style pass, so that its
numbers are the paper code's numbers (checked side by side: README). What the code does:

- **Every layer sees full-precision inputs.** The released calibrator runs "parallel": once a
  layer is calibrated it goes back to float, so no layer ever sees a quantized upstream.
- **Symmetric intervals from a fixed grid.** Each operand's step is one of
  ``(0.01 + 1.19·i/100)·max|x|/(2^(b-1) - 0.5)``, i = 0..99; weights per tensor (q, k and v
  rows of ``qkv`` apart, the patch embedding per output channel), inputs per tensor, the
  operands of q·kᵀ and attn·v per head; the softmax and post-GELU get the twin forms
  (:class:`~vizq.quant.twin.SplitSoftmaxQuantizer`, :class:`~vizq.quant.twin.GeluTwinQuantizer`);
  the patch-embedding input stays float.
- **Alternating search, scored on the layer's output.** Weight step, then input step, three
  rounds, each candidate scored by ``-mean((g·(o - ô))²)`` with ``o`` the layer's float output
  and ``g`` the gradient of KL(p_FP ‖ p) at ``o`` (the "Hessian" metric), on mini-batches of 4.
- **The gradient is taken on the float model itself**, where that KL is at its minimum, so
  ``g`` is rounding noise, not curvature (released-code issue #23): on a CPU, where a batch of
  4 gives the same logits as the batch of 32, ``g`` is ``(Σp - 1)·∂p`` per image, a few 1e-8,
  and exactly 0 for the images whose probabilities sum to exactly 1. The weights of the
  metric are therefore machine-dependent; vizq computes them with the same operations on the
  same shapes, so on one machine it reproduces the released code's choices, and the README
  shows what the degenerate metric costs against plain output MSE (``metric=l2``).

Candidates are evaluated in the chunk sizes the released code derives from its GPU memory
budget, so that even the float rounding of the scores matches.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import Cancelled, InputError
from ..quant import Quantizer
from ..quant.twin import STEP_FRACTIONS

Tensor = torch.Tensor
Progress = Callable[[int, int, str], None]

ROUNDS = 3  # weight/input alternations per layer
GRAD_BATCH = 4  # images per forward/backward pass for the metric's gradient
SPLITS = tuple(2.0**-i for i in range(20))  # softmax split points
#: Bytes of device memory the released code budgets for one chunk of candidates (its GPU's):
#: the chunk sizes, and so the float rounding of the summed scores, follow from these.
CHUNK_BUDGET = {"linear": 3 << 30, "matmul": 3 << 30, "conv": 15 << 30}
#: Linear layers whose weight rows hold several projections searched apart (q, k, v).
ROW_BLOCKS = {"*qkv": 3}


class Metric(str, Enum):
    """How a candidate's layer output is scored."""

    HESSIAN = "hessian"  # the released code: -(g·(o - ô))², g from the float model (see above)
    L2 = "l2"  # plain output MSE, -(o - ô)²: the released code's other metric option


@dataclass
class Layer:
    """One operation the released code quantizes: a Linear/Conv (input site + weight) or one
    of the two attention products (two activation sites)."""

    name: str
    op: str  # "linear", "conv" or "matmul"
    a: str | None  # input (or first operand) site name; None: not quantized
    b: str | None  # weight module path (linear/conv) or second operand site name (matmul)
    stage: int  # capture group: the block index (-1 before the blocks, 10**6 after)
    attn: str = ""  # matmul: the attention module
    n_v: int = 1  # linear: row blocks searched apart


@dataclass
class Captured:
    a: Tensor  # input / first operand (float)
    b: Tensor | None  # second operand (matmul), as the product reads it
    out: Tensor
    grad: Tensor | None
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ what gets calibrated
def layers(qm: Any) -> list[Layer]:
    """The released code's quantized layers, in network order, mapped onto vizq's sites:
    every Linear/Conv with a quantized weight or input, and the two products of every
    attention module. ``stage`` groups them by block for capture."""
    input_of: dict[str, str] = {}  # module path -> the site that quantizes its input
    for s in qm.sites:
        if s.is_activation:
            if s.port == "input":
                input_of[s.module] = s.name
            for c in s.consumers:
                input_of.setdefault(c, s.name)
    block_of = {s.module: s.block for s in qm.sites}
    names = {s.name for s in qm.sites}
    out: list[Layer] = []
    products: dict[str, list[Layer]] = {}  # attention module -> its two products, listed before its proj
    after_blocks = False
    for path, mod in qm.model.named_modules():
        block = block_of.get(path, block_of.get(path + ".q"))
        after_blocks = after_blocks or block is not None
        stage = block if block is not None else (10**6 if after_blocks else -1)
        if isinstance(mod, (nn.Linear, nn.Conv2d)) and (path in qm.weights or path in input_of):
            out += products.pop(path.rsplit(".", 1)[0], []) if path.endswith(".proj") else []
            n_v = next((n for pat, n in ROW_BLOCKS.items() if fnmatch.fnmatchcase(path, pat)), 1)
            op = "conv" if isinstance(mod, nn.Conv2d) else "linear"
            out.append(Layer(path, op, input_of.get(path), path, stage, n_v=n_v))
        elif f"{path}.softmax" in names and all(hasattr(mod, t) for t in ("q", "k", "v", "proj_in", "scale")):
            products[path] = [Layer(f"{path}.matmul1", "matmul", f"{path}.q", f"{path}.k", stage, attn=path),
                              Layer(f"{path}.matmul2", "matmul", f"{path}.softmax", f"{path}.v", stage, attn=path)]
    return out + [l for ls in products.values() for l in ls]


# ------------------------------------------------------------------ capture
def _capture(qm: Any, stage_layers: list[Layer], images: Tensor, target: Tensor,
             cancel: Callable[[], bool] | None) -> dict[str, Captured]:
    """Float tensors and metric gradients of one stage's layers, over mini-batches of
    GRAD_BATCH images: the quantization hooks pass everything through meanwhile."""
    model = qm.model
    parts: dict[str, dict[str, list[Tensor]]] = {l.name: {"a": [], "b": [], "out": [], "grad": []} for l in stage_layers}
    graph: list[tuple[str, Tensor, Callable[[Tensor], Tensor]]] = []  # (layer, tensor to differentiate, grad -> raw grad)
    handles = []

    def linear_hook(name: str) -> Callable:
        def hook(mod: nn.Module, args: tuple, out: Tensor) -> None:
            parts[name]["a"].append(args[0].detach())
            parts[name]["out"].append(out.detach())
            graph.append((name, out, lambda g: g))
        return hook

    def keep(name: str, key: str, fn: Callable[[Tensor], Tensor] = lambda t: t) -> Callable:
        def hook(mod: nn.Module, args: tuple, out: Tensor) -> None:
            parts[name][key].append(fn(out.detach()))
        return hook

    for l in stage_layers:
        if l.op in ("linear", "conv"):
            handles.append(model.get_submodule(l.name).register_forward_hook(linear_hook(l.name)))
            continue
        att = model.get_submodule(l.attn)
        if l.name.endswith("matmul1"):  # q @ kᵀ; its gradient is the softmax input's, times the scale
            scale = float(att.scale)
            handles.append(att.q.register_forward_hook(keep(l.name, "a")))
            handles.append(att.k.register_forward_hook(keep(l.name, "b", lambda t: t.transpose(-2, -1))))

            def logits_hook(mod: nn.Module, args: tuple, out: Tensor, name: str = l.name, scale: float = scale) -> None:
                graph.append((name, args[0], lambda g, s=scale: g * s))
            handles.append(att.softmax.register_forward_hook(logits_hook))
        else:  # attn @ v; its gradient is the projection input's, back in [B, H, N, d]
            heads = att.num_heads
            handles.append(att.softmax.register_forward_hook(keep(l.name, "a")))
            handles.append(att.v.register_forward_hook(keep(l.name, "b")))

            def proj_hook(mod: nn.Module, args: tuple, out: Tensor, name: str = l.name, heads: int = heads) -> None:
                b, n, c = out.shape
                graph.append((name, out, lambda g: g.reshape(b, n, heads, c // heads).transpose(1, 2)))
            handles.append(att.proj_in.register_forward_hook(proj_hook))
    qm.passthrough = True
    try:
        with torch.enable_grad():
            for st in range(0, images.shape[0], GRAD_BATCH):
                if cancel and cancel():
                    raise Cancelled("calibration cancelled; nothing was written")
                graph.clear()
                xb = images[st:st + GRAD_BATCH].detach().requires_grad_(True)
                pred = model(xb)
                loss = F.kl_div(F.log_softmax(pred, dim=-1), target[st:st + GRAD_BATCH], reduction="batchmean")
                grads = torch.autograd.grad(loss, [t for _, t, _ in graph])
                for (name, _, to_raw), g in zip(graph, grads):
                    parts[name]["grad"].append(to_raw(g))
    finally:
        qm.passthrough = False
        for h in handles:
            h.remove()
    out: dict[str, Captured] = {}
    for l in stage_layers:
        p = parts[l.name]
        a = torch.cat(p["a"])
        b = torch.cat(p["b"]) if p["b"] else None
        raw = torch.cat(p["out"]) if p["out"] else a @ b
        out[l.name] = Captured(a, b, raw, torch.cat(p["grad"]))
    return out


# ------------------------------------------------------------------ scoring
def _score(raw: Tensor, sim: Tensor, grad: Tensor | None, metric: Metric) -> Tensor:
    """The released code's similarity before its reductions, ``mean(-(g·(o - ô))², -1)`` (or
    without ``g``), computed in place in ``sim`` (a fresh tensor at every call site): ô - o is
    exactly -(o - ô), and squaring, summing and negating are sign-symmetric in IEEE arithmetic,
    so the result is bit-identical at a third of the memory traffic, which is most of the
    search's time."""
    d = sim.sub_(raw)
    if metric is Metric.HESSIAN:
        d.mul_(grad.reshape_as(raw))
    return d.pow_(2).mean(-1).neg_()


def _chunk(op: str, numel: float) -> int:
    """Candidates per chunk: how many the released code fits in its memory budget."""
    return int((CHUNK_BUDGET[op] / 4) // numel)


def _fractions(device: torch.device) -> Tensor:
    return torch.tensor(STEP_FRACTIONS, device=device)


def _sym(x: Tensor, step: Tensor, q: int) -> Tensor:
    return (x / step).round_().clamp_(-q, q - 1).mul_(step)


def _half(q: Quantizer) -> int:
    return 2 ** (q.bits - 1)


# ------------------------------------------------------------------ searches
def _batch_chunk(n_b: int, numel_per_image: float, op: str) -> tuple[int, int]:
    """(images per chunk, candidates per chunk): the released code halves its calibration batch
    until two candidates fit its memory budget."""
    nb = n_b
    while _chunk(op, numel_per_image * nb) <= 1 and nb > 1:
        nb //= 2
    return nb, _chunk(op, numel_per_image * nb)


def _summed(n_b: int, nb: int, part: Callable[[slice], Tensor]) -> Tensor:
    """Scores per candidate: the chunks' [1, K, ...] scores stacked and summed over chunks."""
    return torch.cat([part(slice(st, st + nb)) for st in range(0, n_b, nb)], 0).sum(0)


def _candidates(per: int) -> list[slice]:
    return [slice(p0, min(len(STEP_FRACTIONS), p0 + per)) for p0 in range(0, len(STEP_FRACTIONS), per)]


def _search_linear(l: Layer, cap: Captured, w: Tensor, bias: Tensor | None, wq: Quantizer | None,
                   aq: Quantizer | None, metric: Metric) -> None:
    """Alternating weight / input step search of one Linear (or of the patch-embedding Conv,
    whose input the released code leaves in float, so only its weight is searched)."""
    x, raw, grad = cap.a, cap.out, cap.grad
    conv = l.op == "conv"
    frac = _fractions(x.device)
    a_search = aq is not None and aq.name in ("uniform_sym", "ptq4vit_gelu") and not conv
    w_search = wq is not None and wq.name == "uniform_sym"
    if aq is not None and not a_search:  # another quantizer: calibrated alone, then held fixed
        aq.calibrate(x)
    if wq is not None and not w_search:
        wq.calibrate(w)
    gelu = a_search and aq.name == "ptq4vit_gelu"
    qw = _half(wq) if wq is not None else 0
    qa = _half(aq) if aq is not None else 0
    n_b = x.shape[0]
    nb, per = _batch_chunk(n_b, 2 * (x.numel() + raw.numel()) / n_b, l.op)
    oc = w.shape[0]
    rows = oc // l.n_v
    # the weight as [n_v, rows, 1, in] (or [oc, in, kh, kw]); steps broadcast against it
    w_view = w if conv else w.view(l.n_v, rows, 1, w.shape[1])
    w_step = w_cands = a_step = a_cands = neg = None
    if w_search:  # min/max steps, then the candidate fractions of them
        w_step = w_view.abs().amax([1, 2, 3] if conv else [1, 3], keepdim=True) / (qw - 0.5)
        w_cands = frac.view(-1, 1, 1, 1, 1) * w_step.unsqueeze(0)
    if a_search:  # post-GELU from its largest value, the others from max |x|
        a_step = ((x.amax() if gelu else x.abs().amax()) / (qa - 0.5)).reshape(1, 1)
        a_cands = frac.view(1, 1, -1) * a_step.unsqueeze(-1)  # [1, 1, 100]
        neg = aq.neg_step(x.device) if gelu else None

    def quant_in(xb: Tensor) -> Tensor:
        if conv or aq is None:
            return xb
        if not a_search:
            return aq.fake_quant(xb)
        return _gelu(xb, a_step, neg, qa) if gelu else _sym(xb.clone(), a_step, qa)

    def weight_scores(i: slice) -> Tensor:  # [1, 100, n_v or oc]
        xs, rb = quant_in(x[i]), raw[i]
        gb = grad[i] if grad is not None else None
        out = []
        for c in _candidates(per):
            cur = w_cands[c]
            k = cur.shape[0]
            ws = (w_view.unsqueeze(0) / cur).round_().clamp_(-qw, qw - 1).mul_(cur)
            bsim = bias.repeat(k) if bias is not None else None
            if conv:
                o = F.conv2d(xs, ws.reshape(-1, *w.shape[1:]), bsim, cap.extra["conv"].stride,
                             cap.extra["conv"].padding, cap.extra["conv"].dilation, cap.extra["conv"].groups)
                d = o.view(o.shape[0], k, oc, *o.shape[2:]).sub_(rb.unsqueeze(1))  # in place, as _score
                if metric is Metric.HESSIAN:
                    d.mul_(gb.unsqueeze(1))
                out.append(torch.mean(d.pow_(2), [3, 4]).neg_().sum(0, keepdim=True))
                continue
            o = F.linear(xs, ws.view(-1, w.shape[1]), bsim)
            o = o.view(*o.shape[:-1], k, l.n_v, rows)
            sc = _score(rb.view(*rb.shape[:-1], 1, l.n_v, rows), o, gb, metric)  # [b, (N,) k, n_v]
            if sc.dim() > 3:
                sc = torch.mean(sc, dim=list(range(1, sc.dim() - 2)))
            out.append(sc.sum(0, keepdim=True))
        return torch.cat(out, 1)

    def input_scores(i: slice) -> Tensor:  # [1, 100]
        xb, rb = x[i], raw[i]
        gb = grad[i] if grad is not None else None
        out = []
        for c in _candidates(per):
            cur = a_cands[:, :, c]
            xe = xb.unsqueeze(-2).unsqueeze(-1)  # [b, (N,) 1, in, 1] against [1, 1, k]
            if gelu:
                xs = (xe / cur).round_().clamp_(0, qa - 1) * cur + (xe / neg).round_().clamp_(-qa, 0) * neg
            else:
                xs = (xe / cur).round_().clamp_(-qa, qa - 1) * cur
            lead = list(range(xs.dim() - 3))
            xs = xs.permute(*lead, -1, -3, -2).reshape(*xb.shape[:-1], cur.shape[-1], xb.shape[-1])
            sc = _score(rb.unsqueeze(-2), F.linear(xs, w_now, bias), gb, metric)  # [b, (N,) k]
            if sc.dim() > 2:
                sc = torch.mean(sc, dim=list(range(1, sc.dim() - 1)))
            out.append(sc.sum(0, keepdim=True))
        return torch.cat(out, 1)

    for _ in range(1 if conv else ROUNDS):  # the conv's rounds would repeat exactly: no input search
        if w_search:
            best = _summed(n_b, nb, weight_scores).argmax(0)
            w_step = w_cands[best, torch.arange(best.numel(), device=x.device)]
        if a_search:
            if w_search:
                w_now = (w_view / w_step).round_().clamp_(-qw, qw - 1).mul_(w_step).view(oc, -1)
            else:
                w_now = w if wq is None else wq.fake_quant(w)
            a_step = a_cands[0, 0, _summed(n_b, nb, input_scores).argmax(0)].reshape(1, 1)
    if w_search:
        step = w_step.reshape(-1)
        if wq.options.get("granularity") == "out_channel":
            step = step if conv else step.repeat_interleave(rows)  # q, k and v rows keep their own step
        elif step.numel() != 1:
            raise InputError(f"the ptq4vit preset searches {l.name}'s weight in {step.numel()} parts; "
                             "give it granularity='out_channel'")
        set_state(wq, w, {"scale": step})
    if a_search:
        set_state(aq, x, {"scale": a_step.reshape(1), **({"neg_scale": neg.reshape(1)} if gelu else {})})


def _gelu(x: Tensor, step: Tensor, neg: Tensor, q: int) -> Tensor:
    return (x / step).round_().clamp_(0, q - 1).mul_(step) + (x / neg).round_().clamp_(-q, 0).mul_(neg)


def _search_matmul(l: Layer, cap: Captured, aq: Quantizer | None, bq: Quantizer | None, metric: Metric) -> None:
    """Alternating search of an attention product's two operands, per head: q·kᵀ with both
    symmetric, attn·v with the softmax's split searched first against the *float* v."""
    A, B, raw, grad = cap.a, cap.b, cap.out, cap.grad
    n_b, heads = A.shape[0], A.shape[1]
    dev = A.device
    frac = _fractions(dev)
    sos = aq is not None and aq.name == "ptq4vit_softmax"
    a_search = aq is not None and (sos or aq.name == "uniform_sym")
    b_search = bq is not None and bq.name == "uniform_sym"
    if aq is not None and not a_search:
        aq.calibrate(A)
    if bq is not None and not b_search:
        bq.calibrate(B if not l.name.endswith("matmul1") else B.transpose(-2, -1))
    nb, per = _batch_chunk(n_b, (A.numel() + B.numel() + 2 * raw.numel()) / n_b, "matmul")
    qa = _half(aq) if aq is not None else 0
    qb = _half(bq) if bq is not None else 0

    def head_max(t: Tensor) -> Tensor:
        return torch.stack([t[i:i + nb].abs().amax((0, 2, 3)) for i in range(0, n_b, nb)]).amax(0)

    a_step = head_max(A) / (qa - 0.5) if a_search and not sos else None  # [H]
    b_step = head_max(B) / (qb - 0.5) if b_search else None
    split = None
    a_cands = frac[:, None] * a_step[None] if a_step is not None else None  # [100, H]
    b_cands = frac[:, None] * b_step[None] if b_search else None
    splits = torch.tensor(SPLITS, device=dev)

    def hv(t: Tensor) -> Tensor:  # per-head steps against [K, b, H, ·, ·]
        return t.view(*t.shape[:-1], 1, t.shape[-1], 1, 1)

    def a_now(t: Tensor) -> Tensor:
        if sos:
            return aq._apply(t, {"split": split})
        if a_search:
            return _sym(t.clone(), a_step.view(1, heads, 1, 1), qa)
        return t if aq is None else _operand_fq(aq, t, l, first=True)

    def b_now(t: Tensor) -> Tensor:
        if b_search:
            return _sym(t.clone(), b_step.view(1, heads, 1, 1), qb)
        return t if bq is None else _operand_fq(bq, t, l, first=False)

    def per_head(make: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        total = None
        for st in range(0, n_b, nb):
            ab, bb, rb = A[st:st + nb], B[st:st + nb], raw[st:st + nb].unsqueeze(0)
            gb = grad[st:st + nb] if grad is not None else None
            chunk = make(ab, bb, rb, gb)
            total = chunk if total is None else torch.cat([total, chunk], 1)
        return total.sum(1)

    def split_scores(ab: Tensor, bb: Tensor, rb: Tensor, gb: Tensor | None) -> Tensor:  # [20, 1]
        sims = [_score(rb, aq._apply(ab.unsqueeze(0), {"split": sp}) @ bb.unsqueeze(0), gb, metric)
                .mean([2, 3]).sum(1, keepdim=True) for sp in splits]
        return torch.cat(sims, 0)

    def operand_scores(first: bool) -> Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]:
        """Scores [100, 1, H] of one operand's candidate steps, the other operand as it is now."""
        cands, q = (a_cands, qa) if first else (b_cands, qb)

        def scores(ab: Tensor, bb: Tensor, rb: Tensor, gb: Tensor | None) -> Tensor:
            moving, fixed = (ab, b_now(bb)) if first else (bb, a_now(ab))
            fixed = fixed.unsqueeze(0)
            sims = []
            for c in _candidates(per):
                cur = hv(cands[c])
                mq = (moving.unsqueeze(0) / cur).round_().clamp_(-q, q - 1).mul_(cur)
                o = mq @ fixed if first else fixed @ mq
                sims.append(_score(rb, o, gb, metric).mean([3]).sum(1, keepdim=True))
            return torch.cat(sims, 0)
        return scores

    every_head = torch.arange(heads, device=dev)
    for _ in range(ROUNDS):
        if sos:  # against the float v, as the released code scores it
            split = splits[per_head(split_scores).argmax(0)]
        elif a_search:
            a_step = a_cands[per_head(operand_scores(True)).argmax(0), every_head]
        if b_search:
            b_step = b_cands[per_head(operand_scores(False)).argmax(0), every_head]
    if sos:
        set_state(aq, A, {"split": split.reshape(1)})
    elif a_search:
        set_state(aq, A, {"scale": _site_scale(aq, a_step)})
    if b_search:
        set_state(bq, B, {"scale": _site_scale(bq, b_step)})


def _site_scale(q: Quantizer, per_head: Tensor) -> Tensor:
    """A head-wise step as the site's quantizer stores it (per head, or one per tensor)."""
    if q.options.get("granularity") == "head":
        return per_head.reshape(-1)
    if per_head.numel() != 1:
        raise InputError(f"the ptq4vit preset searches {q.name} per head; give this site granularity='head'")
    return per_head.reshape(1)


def _operand_fq(q: Quantizer, t: Tensor, l: Layer, first: bool) -> Tensor:
    """A non-searched operand's fake-quant, in the layout the site sees (k is stored as kᵀ here)."""
    if l.name.endswith("matmul1") and not first:
        return q.fake_quant(t.transpose(-2, -1)).transpose(-2, -1)
    return q.fake_quant(t)


def set_state(q: Quantizer, x: Tensor, state: dict[str, Tensor]) -> None:
    """Store searched parameters as the quantizer's calibrated state (axis from the tensor it
    quantizes, as its own ``calibrate`` would set it)."""
    q.axis = q._axis_for(x)
    q.state = {k: v.detach().float().reshape(-1).contiguous() for k, v in state.items()}


# ------------------------------------------------------------------ the procedure
def float_image_batch(qm: Any, images: Tensor | list[Tensor], preset: str) -> Tensor:
    """The calibration images as one batch, and ``qm``'s network back to its float weights
    (whatever an earlier calibration left in it): what a per-layer released-code procedure
    reads. Text batches are refused by name."""
    if isinstance(images, list):
        if len({tuple(t.shape[1:]) for t in images}) != 1:
            raise InputError(f"the {preset} preset calibrates image models (one batch of equal-size images)")
        images = torch.cat(images)
    if images.dim() != 4:
        raise InputError(f"the {preset} preset calibrates image models (a batch of images)")
    with torch.no_grad():
        for path, w in qm.fp_weights.items():
            qm.model.get_submodule(path).weight.data.copy_(w)
    return images


def calibrate(qm: Any, images: Tensor | list[Tensor], metric: Metric = Metric.HESSIAN,
              progress: Progress | None = None, cancel: Callable[[], bool] | None = None) -> None:
    """Calibrate every quantizer of ``qm`` (a fresh :class:`~vizq.ptq.engine.QuantizedModel`
    whose weights are still float) as PTQ4ViT's released code does, then fake-quantize the
    weights. Progress counts quantizers (activation sites and weights)."""
    images = float_image_batch(qm, images, "ptq4vit")
    model = qm.model
    all_layers = layers(qm)
    total = len(qm.acts) + len(qm.weights)
    done = 0
    if progress:
        progress(0, total, "full-precision targets")
    qm.passthrough = True
    try:
        with torch.no_grad():
            target = F.softmax(model(images), dim=-1)
    finally:
        qm.passthrough = False
    for stage in sorted({l.stage for l in all_layers}):
        group = [l for l in all_layers if l.stage == stage]
        caps = _capture(qm, group, images, target, cancel)
        for l in group:
            if cancel and cancel():
                raise Cancelled("calibration cancelled; nothing was written")
            cap = caps.pop(l.name)
            if l.op == "matmul":
                aq = qm.acts[l.a].q if l.a in qm.acts else None
                bq = qm.acts[l.b].q if l.b in qm.acts else None
                _search_matmul(l, cap, aq, bq, metric)
                done += (aq is not None) + (bq is not None)
            else:
                mod = model.get_submodule(l.name)
                cap.extra["conv"] = mod
                wq = qm.weights.get(l.name)
                aq = qm.acts[l.a].q if l.a in qm.acts else None
                with torch.no_grad():
                    _search_linear(l, cap, qm.fp_weights.get(l.name, mod.weight.detach()), mod.bias, wq, aq, metric)
                done += (aq is not None) + (wq is not None)
            if progress:
                progress(min(done, total), total, l.name)
    # anything the layers did not reach (a site whose consumer is not a Linear) calibrates alone
    leftovers = [n for n, a in qm.acts.items() if not a.q.calibrated]
    if leftovers:
        raise InputError(f"the ptq4vit preset cannot calibrate {', '.join(leftovers[:3])}: no layer of the released "
                         "code reads them; disable these sites or use another preset")
    for a in qm.acts.values():
        a.compile()
    with torch.no_grad():
        for path, q in qm.weights.items():
            mod = model.get_submodule(path)
            if not q.calibrated:
                q.calibrate(qm.fp_weights[path])
            mod.weight.data.copy_(q.fake_quant(qm.fp_weights[path]))
