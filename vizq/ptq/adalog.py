"""AdaLog's calibration, done the way its released code (GoatWu/AdaLog) does it.

The ``adalog-released`` preset runs this instead of the sequential RepQ-ViT-style pass that the
``adalog`` preset puts around AdaLog's quantizers, so that its numbers are the paper code's.
What the code does (its ``configs/4bit.py``: 128 candidates, 3 rounds, FPCS with 6 passes):

- **Every layer is calibrated on float tensors.** The network stays float throughout; its only
  change is the post-LN fold below, applied as soon as ``qkv`` / ``fc1`` is calibrated, so the
  layers after it read the folded network (the same function, other float rounding).
- **Asymmetric uniform grids, range and zero point searched together.** Candidates: ``num_scale``
  ranges from the 0.9..0.1 quantile spread to the full one, times ``num_zp`` integer zero points
  around mid-grid. FPCS keeps the best 16, puts 8 new candidates around each at the current
  spacing, shrinks the spacing by 7.5 and repeats: six passes.
- **Scored on the tensor itself first, then on the layer's output.** Weight rows, then the
  input (per tensor), by their own MSE; then three rounds of weight rows and input by the MSE of
  the layer's float output. q, k and v are searched per head on the MSE of q·kᵀ and attn·v.
- **Post-LN per channel, folded.** The inputs of ``qkv`` and ``fc1`` are searched per channel
  (own MSE), folded into the LayerNorm with the mean scale and the *rounded* mean zero point,
  then searched again (per tensor, the whole procedure above) on the folded tensor.
- **AdaLog's quantizers.** Post-softmax: scale 1, base q in 10..137 (2^(-q/37) per code)
  searched on attn·v; post-GELU: x + 0.16997… with its scale and q searched together (FPCS over
  8 bases × 16 scales) on fc2's output. Both dequantize through the released code's table,
  rounded to 1/(2^(b+1) − 2) (the quantizer's ``table="released"``).
- **Patch-embedding input float** (the code's 8-bit setting for it quantizes nothing), its
  weight searched on its output; the head's input at the activation width; weights per row.

Candidates are scored in the chunks the released code sizes from its device memory
(:data:`DEVICE_MEMORY`: a 24 GiB card), calibration batches of :data:`CALIB_BATCH`, with the
same reductions in the same order, so that the float rounding of every score is the code's.
Checked side by side with the released code (README).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import Cancelled, InputError
from ..quant import Quantizer
from .ptq4vit import Layer, float_image_batch, layers, set_state
from .reparam import Fold, apply_fold

Tensor = torch.Tensor
Progress = Callable[[int, int, str], None]
Search = Callable[[Tensor, Tensor, int], Tensor]

EQ_N = 128  # candidates per pass
ROUNDS = 3  # weight/input alternations scored on the layer's output
STEPS = 6  # FPCS passes
WIDTH = 16  # FPCS survivors per pass (32 for the post-GELU scale/base pairs)
R = 37.0  # AdaLog's base is 2^(-q/R)
Q_FIRST = 10  # bases q searched: Q_FIRST .. Q_FIRST + EQ_N - 1
GELU_SHIFT = 0.16997124254703522  # the released code's |min GELU|
#: Device memory the released code sizes its candidate chunks from (it budgets half of it).
DEVICE_MEMORY = 24 << 30
CALIB_BATCH = 32  # images per scoring batch (the code's calib_batch_size)
FOLDED = ("qkv", "fc1")  # Linear layers whose per-channel post-LN input is folded


@dataclass
class Captured:
    x: Tensor  # input (first operand)
    b: Tensor | None  # second operand as the product reads it (kᵀ for q·kᵀ)
    out: Tensor  # the float output


@dataclass
class Grid:
    """An asymmetric uniform grid: (clamp(round(x/s) + z, 0, qmax) - z)·s, the code's order."""

    scale: Tensor
    zero_point: Tensor
    qmax: int

    def __call__(self, x: Tensor) -> Tensor:
        return (torch.round(x / self.scale) + self.zero_point).clamp(0, self.qmax).sub_(self.zero_point).mul_(self.scale)


def _per_chunk(numel: float) -> int:
    """Candidates per chunk, as the released code sizes them from its memory budget."""
    p = max(1, int(((DEVICE_MEMORY // 2) / 4) // numel))
    return math.ceil(EQ_N / math.ceil(EQ_N / p))


def _chunks(n: int, per: int) -> list[slice]:
    return [slice(p, min(n, p + per)) for p in range(0, n, per)]


def _batches(n: int) -> list[slice]:
    return [slice(b, min(n, b + CALIB_BATCH)) for b in range(0, n, CALIB_BATCH)]


def _quantile(x: Tensor, q: Tensor) -> Tensor:
    """Quantiles of a whole tensor, as the code takes them (one row, then its mean: it would
    split a tensor that torch.quantile refused; this torch takes any size)."""
    return torch.quantile(x.reshape(1, -1), q, dim=-1).mean(dim=-1)


def _pct(dev: torch.device) -> tuple[Tensor, Tensor]:
    """The upper [0.9, 1] and lower (1 - that, in float32) quantile levels."""
    p = torch.tensor([0.9, 1.0])
    return p.to(dev), (1 - p).to(dev)


def _grid(up: Tensor, low: Tensor, n_levels: int, num_zp: int, view: tuple[int, ...],
          clamp: float | None = None) -> tuple[Tensor, Tensor]:
    """Scale and zero-point candidates (K first, then ``view``) from [2, …] upper and lower
    quantiles: the spread grows from the 0.9..0.1 one to the full one; each zero point repeats
    all the scales."""
    dev = up.device
    num_scale = EQ_N // num_zp
    d_min, d_max = (up[0] - low[0]).reshape(view), (up[1] - low[1]).reshape(view)
    lead = (-1,) + (1,) * (len(view) - 1)
    splits = torch.linspace(0, 1, steps=num_scale, device=dev).reshape(lead) * (d_max - d_min)
    s = (d_min + splits).repeat(num_zp, *[1] * (len(view) - 1)) / (2 * n_levels - 1)
    if clamp is not None:
        s = s.clamp(min=clamp)
    zp = torch.arange(int(n_levels - num_zp / 2), int(n_levels + num_zp / 2), device=dev).repeat_interleave(num_scale)
    return s, zp.reshape(lead).expand_as(s).contiguous()


def _fpcs(scales: Tensor, zps: Tensor, dim: int, search: Search, width: int = WIDTH,
          clamp: float | None = None) -> None:
    """FPCS along candidate axis ``dim``: keep the ``width`` best, refine each by EQ_N // width
    offsets of the current spacing, shrink it, repeat; the last pass keeps one (``search``
    stores it)."""
    d = dim % scales.dim()
    new = EQ_N // width
    delta = scales.narrow(d, 1, 1) - scales.narrow(d, 0, 1)
    idx = search(scales, zps, width)
    top_s, top_z = scales.gather(d, idx), zps.gather(d, idx)
    for left in range(STEPS - 1, 0, -1):
        shape = [1] * scales.dim()
        shape[d] = new
        offs = (torch.linspace(0, 1, steps=new, device=scales.device).reshape(shape) - 0.5) * delta
        delta = delta / (new - 0.5)
        scales = (top_s.unsqueeze(d + 1) + offs.unsqueeze(d)).flatten(d, d + 1)
        if clamp is not None:
            scales = scales.clamp(min=clamp)
        zps = top_z.repeat_interleave(new, dim=d)
        idx = search(scales, zps, 1 if left == 1 else width)
        if left > 1:
            top_s, top_z = scales.gather(d, idx), zps.gather(d, idx)


def _topk(sim: Tensor, k: int, dim: int) -> Tensor:
    return torch.topk(sim, k=k, dim=dim).indices


def search_table(bits: int) -> Tensor:
    """The table the released code's searches index: 2^(-j/37), j < 120, rounded to
    1/(2^(b+1) - 2) in float32 (its quantizers' own table is built in float64: see
    :func:`vizq.quant.logq.released_table`)."""
    t = torch.tensor([2 ** (-j / R) for j in range(120)])
    step = 1.0 / (4 * 2 ** (bits - 1) - 2)
    return torch.round(t / step) * step


def eval_tables(q: int, bits: int) -> tuple[Tensor, Tensor]:
    """The shift and table entries per code of an AdaLog quantizer with base q (the code's
    ``update_table``): floor(i·q/37) and 2^(-((q·i) mod 37)/37) on the table's grid."""
    n = 2 ** (bits - 1)
    den = 4 * n - 2
    t1 = torch.tensor([math.floor(i * q / R) for i in range(2 * n)], dtype=torch.float32)
    t2 = torch.tensor([round((2 ** (-((q * i) % R) / R)) * den) / den for i in range(2 * n)], dtype=torch.float32)
    return t1, t2


def adalog_fq(x: Tensor, scale: Tensor, q: int, bits: int) -> Tensor:
    """An AdaLog quantizer's forward in the released code (scale, base q)."""
    n = 2 ** (bits - 1)
    a = (x / scale).clamp(min=1e-15, max=1.0)
    c = torch.round(-a.log2() * R / torch.tensor([q], device=x.device))
    mask = c < 2 * n
    c = torch.clamp(c, 0, 2 * n - 1).long()
    t1, t2 = eval_tables(q, bits)
    t1, t2 = t1.to(x.device), t2.to(x.device)
    return (2 ** (-t1[c])) * t2[c] * scale * mask


def _adalog_cands(a: Tensor, q: Tensor, n: int, table: Tensor) -> Tensor:
    """The search's AdaLog codes of ``a`` (already scaled) for candidate bases ``q``, dequantized."""
    c = torch.round(-a.log2() * R / q)
    mask = c >= 2 * n
    c = c.clamp_(0, 2 * n - 1)
    col = torch.remainder(c * q, R).round_().long()
    out = (2 ** (-1 * torch.floor(c * q / R))) * table.to(a.device)[col]
    out[mask] = 0
    return out


# ------------------------------------------------------------------ Linear and Conv
class _Linear:
    """One Linear (or the patch-embedding Conv), its float tensors and the code's searches.
    The weight is searched as [n_v, rows, in] (q, k and v rows apart; conv: [oc, ic·kh·kw])."""

    def __init__(self, l: Layer, cap: Captured, mod: nn.Module, w: Tensor, wbits: int, abits: int | None) -> None:
        self.l, self.mod, self.conv = l, mod, l.op == "conv"
        self.x, self.out = cap.x, cap.out
        self.w, self.bias = w, (mod.bias.detach() if mod.bias is not None else None)
        self.nw = 2 ** (wbits - 1)
        self.na = 2 ** (abits - 1) if abits else 0
        self.abits = abits
        oc = w.shape[0]
        self.n_v = 1 if self.conv else l.n_v
        self.wv = w.reshape(oc, -1) if self.conv else w.view(self.n_v, oc // self.n_v, w.shape[1])
        self.wview = (-1, oc, 1) if self.conv else (-1, self.n_v, oc // self.n_v, 1)
        b = min(CALIB_BATCH, self.x.shape[0])
        if self.conv:
            self.per = _per_chunk(2 * self.x[:b].numel() + 2 * self.out[:b].numel())
        else:
            self.per = _per_chunk(8 * self.x[:b].numel() + 16 * self.out[:b].numel())
        self.wq: Grid | None = None
        self.aq: Grid | None = None
        self.channel = False  # the input searched per channel (before the fold)

    # weights ----------------------------------------------------------
    def weight_grid(self) -> tuple[Tensor, Tensor]:
        hi, lo = _pct(self.w.device)
        up = torch.quantile(self.wv, hi, dim=-1)
        low = torch.quantile(self.wv, lo, dim=-1)
        num_zp = self.nw if self.conv else min(16, self.nw)
        return _grid(up, low, self.nw, num_zp, (1,) + self.wview[1:])

    def _keep_w(self, s: Tensor, z: Tensor, idx: Tensor) -> None:
        self.wq = Grid(s.gather(0, idx).squeeze(0), z.gather(0, idx).squeeze(0).float(), 2 * self.nw - 1)

    def _wq_cands(self, s: Tensor, z: Tensor) -> Tensor:
        q = ((self.wv.unsqueeze(0) / s).round_() + z).clamp(0, 2 * self.nw - 1)
        return (q - z) * s if not self.conv else (q - z).mul_(s)

    def w_self(self, s: Tensor, z: Tensor, k: int) -> Tensor:
        """Weight rows by their own MSE."""
        raw = self.wv.unsqueeze(0)
        sims = [torch.mean(-(raw - self._wq_cands(s[c], z[c])) ** 2, dim=-1) for c in _chunks(s.shape[0], self.per)]
        idx = _topk(torch.cat(sims, 0), k, 0).reshape(k, *self.wview[1:])
        if k == 1:
            self._keep_w(s, z, idx)
        return idx

    def w_out(self, s: Tensor, z: Tensor, k: int) -> Tensor:
        """Weight rows by the MSE of the layer's output, the input as now quantized."""
        per_batch = []
        for b in _batches(self.x.shape[0]):
            xs = self.quant_in(self.x[b])
            sims = []
            for c in _chunks(s.shape[0], self.per):
                n = c.stop - c.start
                bias = self.bias.repeat(n) if self.bias is not None else None
                if self.conv:
                    m = self.mod
                    wq = self._wq_cands(s[c], z[c]).view(-1, *self.w.shape[1:])
                    o = F.conv2d(xs, wq, bias, m.stride, m.padding, m.dilation, m.groups)
                    o = torch.cat(torch.chunk(o.unsqueeze(1), chunks=n, dim=2), dim=1)
                    sims.append(torch.sum(torch.mean(-(self.out[b].unsqueeze(1) - o) ** 2, [3, 4]), dim=0, keepdim=True))
                    continue
                raw = self.out[b].unsqueeze(-2)
                raw = raw.view(*raw.shape[:-1], self.n_v, -1)
                o = F.linear(xs, self._wq_cands(s[c], z[c]).view(-1, self.w.shape[1]), bias)
                o = o.view(*o.shape[:-1], n, self.n_v, -1)
                sim = -(raw - o) ** 2
                if sim.dim() > 4:
                    sim = torch.mean(sim, dim=list(range(1, sim.dim() - 3)))
                sims.append(sim.sum(dim=0, keepdim=True))
            per_batch.append(torch.cat(sims, 1))
        idx = _topk(torch.cat(per_batch, 0).sum(0), k, 0).reshape(k, *self.wview[1:])
        if k == 1:
            self._keep_w(s, z, idx)
        return idx

    def w_now(self) -> Tensor:
        return self.wq(self.wv).view(self.w.shape)

    def quant_in(self, x: Tensor) -> Tensor:
        return x if self.aq is None else self.aq(x)

    # inputs -----------------------------------------------------------
    def input_grid(self) -> tuple[Tensor, Tensor]:
        """[G, K] candidates (G = channels before the fold, else 1); scales at least 1e-4."""
        hi, lo = _pct(self.x.device)
        if self.channel:
            flat = self.x.reshape(-1, self.x.shape[-1])
            up, low = torch.quantile(flat, hi, dim=0), torch.quantile(flat, lo, dim=0)  # [2, C]
        else:
            up, low = _quantile(self.x, hi)[:, None], _quantile(self.x, lo)[:, None]  # [2, 1]
        s, z = _grid(up, low, self.na, min(16, 2 * self.na), (1, up.shape[1]), clamp=1e-4)
        return s.transpose(0, 1).contiguous(), z.transpose(0, 1).contiguous()

    def _keep_a(self, s: Tensor, z: Tensor, idx: Tensor) -> None:
        self.aq = Grid(s.gather(-1, idx).squeeze(-1), z.gather(-1, idx).squeeze(-1).float(), 2 * self.na - 1)

    def a_self(self, s: Tensor, z: Tensor, k: int) -> Tensor:
        """The input by its own MSE (per channel or per tensor)."""
        per_batch = []
        for b in _batches(self.x.shape[0]):
            raw = self.x[b].unsqueeze(-1)
            sims = []
            for c in _chunks(s.shape[-1], self.per):
                xq = ((raw / s[:, c]).round_() + z[:, c]).clamp_(0, 2 * self.na - 1)
                sim = -(raw - (xq - z[:, c]) * s[:, c]) ** 2
                if sim.dim() > 3:
                    sim = torch.mean(sim, dim=list(range(1, sim.dim() - 2)))
                if not self.channel:
                    sim = torch.mean(sim, dim=1, keepdim=True)
                sims.append(torch.sum(sim, dim=0, keepdim=True))
            per_batch.append(torch.cat(sims, -1))
        idx = _topk(torch.cat(per_batch, 0).sum(0), k, -1)
        if k == 1:
            self._keep_a(s, z, idx)
        return idx

    def _a_scores(self, make: Callable[[Tensor, slice], Tensor], n: int) -> Tensor:
        """[1, K] output scores of input candidates: ``make(x, chunk)`` gives the dequantized
        candidates [b, …, in, k]; scored through the weight as now quantized."""
        w = self.w_now()
        per_batch = []
        for b in _batches(self.x.shape[0]):
            x, raw = self.x[b], self.out[b].unsqueeze(-2)
            sims = []
            for c in _chunks(n, self.per):
                xs = make(x.unsqueeze(-1), c)
                xs = xs.permute(*range(xs.dim() - 2), -1, -2)
                sim = torch.mean(-(raw - F.linear(xs, w, self.bias)) ** 2, dim=-1)
                if sim.dim() > 2:
                    sim = torch.mean(sim, dim=list(range(1, sim.dim() - 1)))
                sims.append(torch.sum(sim, dim=0, keepdim=True))
            per_batch.append(torch.cat(sims, 1))
        return torch.cat(per_batch, 0).sum(0, keepdim=True)

    def a_out(self, s: Tensor, z: Tensor, k: int) -> Tensor:
        """The (per-tensor) input by the MSE of the layer's output."""
        def make(xe: Tensor, c: slice) -> Tensor:
            xq = ((xe / s[:, c]).round_() + z[:, c]).clamp_(0, 2 * self.na - 1)
            return (xq - z[:, c]) * s[:, c]
        idx = _topk(self._a_scores(make, s.shape[-1]), k, -1)
        if k == 1:
            self._keep_a(s, z, idx)
        return idx

    # the procedure ----------------------------------------------------
    def search(self) -> None:
        """The code's order for a Linear (after any fold) or the Conv."""
        if self.conv:  # its input stays float: one round of the weight on the output
            s, z = self.weight_grid()
            self.wq = Grid(s[-2], z[-2].float(), 2 * self.nw - 1)
            _fpcs(*self.weight_grid(), 0, self.w_out)
            return
        _fpcs(*self.weight_grid(), 0, self.w_self)
        if self.na:
            _fpcs(*self.input_grid(), -1, self.a_self, clamp=1e-4)
        for _ in range(ROUNDS):
            _fpcs(*self.weight_grid(), 0, self.w_out)
            if self.na:
                _fpcs(*self.input_grid(), -1, self.a_out, clamp=1e-4)

    def search_channels(self) -> None:
        """Before the fold: the input per channel by its own MSE, nothing else."""
        self.channel = True
        _fpcs(*self.input_grid(), -1, self.a_self, clamp=1e-4)

    def fold(self) -> Fold:
        """The code's fold of the per-channel input grid: mean scale, rounded mean zero point;
        the input becomes x/r - δ and the grid is searched again per tensor."""
        s, z = self.aq.scale, self.aq.zero_point
        st = torch.mean(s).view(1)
        zt = torch.mean(z).round().view(1)
        r = s / st
        delta = (-z * s) / r - (-zt * st)
        self.x = self.x / r - delta
        self.channel = False
        self.aq = None
        return Fold(r, delta, float(st), float(zt))


def _positive_percentile(x: Tensor, q: Tensor) -> Tensor:
    """Nearest-rank quantiles of the positive values (the code's ``positive_percentile``)."""
    pos = torch.where(x > 0, x, torch.tensor(float("nan"), device=x.device))
    srt, _ = pos.sort(dim=0)
    counts = (~torch.isnan(srt)).sum(dim=0, keepdim=True).float()
    ranks = ((counts * q.reshape(-1, 1)).ceil().long() - 1).clamp(min=0)
    out = torch.gather(srt.unsqueeze(0).expand(q.numel(), *srt.shape), 1, ranks).squeeze(1)
    return out.masked_fill_(torch.isnan(out), 0)


class _PostGelu(_Linear):
    """fc2: AdaLog on x + η, scale and base searched together on fc2's output."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.shift = torch.tensor([GELU_SHIFT], device=self.x.device)
        self.table = search_table(self.abits)
        self.scale = torch.zeros(1, device=self.x.device)
        self.q = int(R)

    def quant_in(self, x: Tensor) -> Tensor:
        return adalog_fq(x + self.shift, self.scale, self.q, self.abits) - self.shift

    def _scores(self, scales: Tensor, qs: Tensor, k: int) -> Tensor:
        def make(xe: Tensor, c: slice) -> Tensor:
            s = scales[:, c]
            a = ((xe + self.shift) / s).clamp(min=1e-15, max=1.0)
            return _adalog_cands(a, qs[:, c], self.na, self.table) * s - self.shift
        return _topk(self._a_scores(make, scales.shape[-1]), k, -1)

    def search(self) -> None:
        _fpcs(*self.weight_grid(), 0, self.w_self)
        hi, _ = _pct(self.x.device)
        ud = (_positive_percentile(self.x.reshape(-1), hi) + self.shift.item()).unsqueeze(0)  # [1, 2]
        frac = torch.tensor([i / (EQ_N - 1) for i in range(EQ_N)], device=self.x.device).view(1, -1)
        self.scale = (ud[:, 0:1] + (ud[:, 1:] - ud[:, 0:1]) * frac)[:, -2]
        for _ in range(ROUNDS):
            self._scale_base_fpcs(ud)
            _fpcs(*self.weight_grid(), 0, self.w_out)

    def _scale_base_fpcs(self, ud: Tensor, bases: int = 8, n_scales: int = 16, width: int = 32) -> None:
        """The bases alone at the current scale (the best 8), then FPCS over 8 bases × 16 scales."""
        q_all = torch.arange(Q_FIRST, Q_FIRST + EQ_N, device=self.x.device).view(1, -1)
        top = self._scores(self.scale.view(1, 1).expand(1, EQ_N), q_all, bases)
        frac = torch.tensor([i / (n_scales - 1) for i in range(n_scales)], device=self.x.device).view(1, -1)
        s = ud[:, 0:1] + (ud[:, 1:] - ud[:, 0:1]) * frac
        q = q_all.gather(-1, top).repeat_interleave(n_scales, dim=-1)

        def keep(sc: Tensor, qq: Tensor, k: int) -> Tensor:
            idx = self._scores(sc, qq, k)
            if k == 1:
                self.scale = sc.gather(-1, idx).reshape(1)
                self.q = int(qq.gather(-1, idx))
            return idx
        _fpcs(s.repeat(1, bases), q, -1, keep, width=width)


# ------------------------------------------------------------------ attention products
class _Product:
    """q·kᵀ (both operands asymmetric per head) or attn·v (AdaLog softmax, v per head)."""

    def __init__(self, l: Layer, cap: Captured, abits: int, bbits: int, softmax: bool) -> None:
        self.l, self.A, self.B, self.out = l, cap.x, cap.b, cap.out
        self.softmax = softmax
        self.abits, self.na, self.nb = abits, 2 ** (abits - 1), 2 ** (bbits - 1)
        b = min(CALIB_BATCH, self.A.shape[0])
        self.per = _per_chunk(4 * self.A.numel() + 4 * self.B.numel() + 8 * self.out[:b].numel())
        self.aq: Grid | None = None
        self.bq: Grid | None = None
        self.q = int(R)
        self.table = search_table(abits) if softmax else None

    def grid(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head candidates [K, 1, H, 1, 1] (the zero points count v/k's levels)."""
        heads = x.shape[1]
        x_ = x.transpose(0, 1).contiguous().view(heads, 1, -1)
        hi, lo = _pct(x.device)
        up = torch.quantile(x_, hi, dim=-1).mean(dim=-1)
        low = torch.quantile(x_, lo, dim=-1).mean(dim=-1)
        return _grid(up, low, self.nb, min(16, self.nb), (1, 1, heads, 1, 1))

    def a_now(self, a: Tensor) -> Tensor:
        if self.softmax:
            return adalog_fq(a, torch.ones(1, 1, 1, 1, device=a.device), self.q, self.abits)
        return self.aq(a)

    def _scores(self, make: Callable[[Tensor, Tensor, slice], Tensor], n: int, per_head: bool) -> Tensor:
        per_batch = []
        for b in _batches(self.A.shape[0]):
            A, B, raw = self.A[b], self.B[b], self.out[b].unsqueeze(0)
            sims = []
            for c in _chunks(n, self.per):
                sim = -(raw - make(A, B, c)) ** 2
                sim = torch.mean(sim, dim=list(range(3 if per_head else 2, sim.dim())))
                sims.append(sim.sum(dim=1, keepdim=True))
            per_batch.append(torch.cat(sims, 0))
        return torch.cat(per_batch, 1).sum(1, keepdim=not per_head)

    def _operand(self, first: bool) -> Search:
        n = self.na if first else self.nb

        def search(s: Tensor, z: Tensor, k: int) -> Tensor:
            def make(A: Tensor, B: Tensor, c: slice) -> Tensor:
                moving = A.squeeze(0) if first else B.squeeze(0)
                mq = ((moving / s[c]).round_() + z[c]).clamp(0, 2 * n - 1)
                mq = (mq - z[c]).mul_(s[c])
                return mq @ self.bq(B).unsqueeze(0) if first else self.a_now(A).unsqueeze(0) @ mq
            idx = _topk(self._scores(make, s.shape[0], per_head=True), k, 0).view(k, 1, -1, 1, 1)
            if k == 1:
                g = Grid(s.gather(0, idx).view(1, -1, 1, 1), z.gather(0, idx).view(1, -1, 1, 1).float(), 2 * n - 1)
                if first:
                    self.aq = g
                else:
                    self.bq = g
            return idx
        return search

    def _base(self) -> None:
        """The softmax's base alone (scale 1), on attn·v with v as now quantized."""
        qs = torch.arange(Q_FIRST, Q_FIRST + EQ_N, device=self.A.device).view(-1, 1, 1, 1, 1)

        def make(A: Tensor, B: Tensor, c: slice) -> Tensor:
            return _adalog_cands(A.squeeze(0), qs[c], self.na, self.table) @ self.bq(B).unsqueeze(0)
        self.q = int(qs.view(-1)[_topk(self._scores(make, EQ_N, per_head=False), 1, 0).view(-1)])

    def search(self) -> None:
        s, z = self.grid(self.B)
        self.bq = Grid(s[-2], z[-2].float(), 2 * self.nb - 1)
        if not self.softmax:
            s, z = self.grid(self.A)
            self.aq = Grid(s[-2], z[-2].float(), 2 * self.na - 1)
        for _ in range(ROUNDS):
            if self.softmax:
                self._base()
            else:
                _fpcs(*self.grid(self.A), 0, self._operand(True))
            _fpcs(*self.grid(self.B), 0, self._operand(False))


# ------------------------------------------------------------------ capture
def _capture(qm: Any, group: list[Layer], images: Tensor) -> dict[str, Captured]:
    """Float inputs and outputs of one group's layers, in one forward of all the images
    (the code's single calibration batch), the quantization hooks passing everything through."""
    model = qm.model
    got: dict[str, dict[str, Tensor]] = {l.name: {} for l in group}
    handles = []

    def keep(name: str, key: str, fn: Callable[[Tensor], Tensor] = lambda t: t, inp: bool = False) -> Callable:
        def hook(mod: nn.Module, args: tuple, out: Tensor) -> None:
            got[name][key] = fn((args[0] if inp else out).detach())
        return hook

    for l in group:
        if l.op in ("linear", "conv"):
            m = model.get_submodule(l.name)
            handles += [m.register_forward_hook(keep(l.name, "x", inp=True)), m.register_forward_hook(keep(l.name, "out"))]
            continue
        att = model.get_submodule(l.attn)
        if l.name.endswith("matmul1"):
            handles += [att.q.register_forward_hook(keep(l.name, "x")),
                        att.k.register_forward_hook(keep(l.name, "b", lambda t: t.transpose(-2, -1)))]
        else:
            handles += [att.softmax.register_forward_hook(keep(l.name, "x")), att.v.register_forward_hook(keep(l.name, "b"))]
    qm.passthrough = True
    try:
        with torch.no_grad():
            model(images)
    finally:
        qm.passthrough = False
        for h in handles:
            h.remove()
    caps = {}
    for l in group:
        g = got[l.name]
        out = g["out"] if "out" in g else g["x"] @ g["b"]  # the product as the forward computes it
        # the code concatenates what its hooks saw (one batch: a copy, contiguous)
        caps[l.name] = Captured(torch.cat([g["x"]]), torch.cat([g["b"]]) if "b" in g else None, out)
    return caps


def _groups(all_layers: list[Layer]) -> list[list[Layer]]:
    """Layers in capture groups, each ending at a folded layer: the layers after a fold must
    read the folded network."""
    out, cur = [], []
    for l in all_layers:
        cur.append(l)
        if l.name.rsplit(".", 1)[-1] in FOLDED:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def _check(q: Quantizer | None, names: tuple[str, ...], where: str) -> None:
    if q is not None and q.name not in names:
        raise InputError(f"the adalog-released preset searches {where} as {' or '.join(names)}, not {q.name}; "
                         "remove the override or use the adalog preset")


# ------------------------------------------------------------------ the procedure
def calibrate(qm: Any, images: Tensor | list[Tensor], progress: Progress | None = None,
              cancel: Callable[[], bool] | None = None) -> None:
    """Calibrate every quantizer of ``qm`` (a fresh :class:`~vizq.ptq.engine.QuantizedModel`
    whose weights are still float) as AdaLog's released code does, fold the post-LN grids,
    then fake-quantize the weights. Progress counts layers."""
    images = float_image_batch(qm, images, "adalog-released")
    model = qm.model
    site_of = {s.name: s for s in qm.sites}
    all_layers = layers(qm)
    total, done = len(all_layers), 0
    if progress:
        progress(0, total, "capturing float tensors")
    for group in _groups(all_layers):
        caps = _capture(qm, group, images)
        for l in group:
            if cancel and cancel():
                raise Cancelled("calibration cancelled; nothing was written")
            cap = caps.pop(l.name)
            with torch.no_grad():
                if l.op == "matmul":
                    _product(qm, l, cap)
                else:
                    _layer(qm, l, cap, site_of)
            done += 1
            if progress:
                progress(done, total, l.name)
    leftovers = [n for n, a in qm.acts.items() if not a.q.calibrated]
    if leftovers:
        raise InputError(f"the adalog-released preset cannot calibrate {', '.join(leftovers[:3])}: no layer of the "
                         "released code reads them; disable these sites or use another preset")
    for a in qm.acts.values():
        a.compile()
    with torch.no_grad():
        for path, q in qm.weights.items():
            if not q.calibrated:
                raise InputError(f"the adalog-released preset found no layer for the weight of {path}")
            model.get_submodule(path).weight.data.copy_(q.fake_quant(qm.fp_weights[path]))


def _layer(qm: Any, l: Layer, cap: Captured, site_of: dict[str, Any]) -> None:
    mod = qm.model.get_submodule(l.name)
    wq = qm.weights.get(l.name)
    act = qm.acts.get(l.a) if l.a else None
    aq = act.q if act is not None else None
    _check(wq, ("uniform",), f"{l.name}'s weight")
    if wq is None:
        raise InputError(f"the adalog-released preset quantizes every weight; {l.name}'s is left float")
    gelu = aq is not None and site_of[l.a].kind == "post_gelu"
    _check(aq, ("adalog",) if gelu else ("uniform",), f"{l.name}'s input")
    w = qm.fp_weights[l.name]
    abits = aq.bits if aq is not None else None
    lin = (_PostGelu if gelu else _Linear)(l, cap, mod, w, wq.bits, abits)
    folded = aq is not None and l.name.rsplit(".", 1)[-1] in FOLDED and site_of[l.a].kind == "post_ln"
    if folded:
        lin.search_channels()
        fold = lin.fold()
        site = site_of[l.a]
        if site.port == "consumers":
            raise InputError("the adalog-released preset folds post-LN grids into the LayerNorm (pre-LN models only)")
        consumers = [qm.model.get_submodule(c) for c in site.consumers]
        for c, m in zip(site.consumers, consumers):
            m.weight.data.copy_(qm.fp_weights[c])
        apply_fold(qm.model.get_submodule(site.module), consumers, fold)
        for c, m in zip(site.consumers, consumers):
            qm.fp_weights[c] = m.weight.detach().clone()
        qm.folds[l.a] = fold
        lin.w = qm.fp_weights[l.name]
        lin.wv = lin.w.view(lin.n_v, lin.w.shape[0] // lin.n_v, lin.w.shape[1])
        lin.bias = mod.bias.detach()
    lin.search()
    set_state(wq, w, {"scale": lin.wq.scale, "zero_point": lin.wq.zero_point})
    if gelu:
        set_state(aq, cap.x, {"scale": lin.scale, "base_q": torch.tensor([float(lin.q)])})
    elif aq is not None:
        set_state(aq, cap.x, {"scale": lin.aq.scale, "zero_point": lin.aq.zero_point})


def _product(qm: Any, l: Layer, cap: Captured) -> None:
    act_a, act_b = qm.acts.get(l.a), qm.acts.get(l.b)
    if act_a is None or act_b is None:
        raise InputError(f"the adalog-released preset quantizes both operands of {l.name}")
    softmax = l.name.endswith("matmul2")
    _check(act_a.q, ("adalog",) if softmax else ("uniform",), f"{l.name}'s first operand")
    _check(act_b.q, ("uniform",), f"{l.name}'s second operand")
    p = _Product(l, cap, act_a.q.bits, act_b.q.bits, softmax)
    p.search()
    if softmax:
        set_state(act_a.q, cap.x, {"scale": torch.ones(1), "base_q": torch.tensor([float(p.q)])})
    else:
        set_state(act_a.q, cap.x, {"scale": p.aq.scale, "zero_point": p.aq.zero_point})
    b = cap.b.transpose(-2, -1) if l.name.endswith("matmul1") else cap.b  # the site sees k, not kᵀ
    set_state(act_b.q, b, {"scale": p.bq.scale, "zero_point": p.bq.zero_point})
