"""The quantizer interface, granularity handling and the name registry.

A quantizer is a small stateful object: ``calibrate(x)`` fixes its parameters from data,
``fake_quant(x)`` maps values onto its grid (quantize, then dequantize), ``levels()`` lists the
representable values, and ``to_dict``/``from_dict`` round-trip it exactly. Parameters live in
``self.state`` as float32 tensors so export can write them to safetensors unchanged.

Non-finite values, one rule for every quantizer and for the compiled kernel: calibration
refuses them (a range cannot be fitted to NaN); ``fake_quant`` returns NaN where the input is
NaN, saturates ±inf at the grid's extreme levels, and neither changes any other output value
(block formats compute their scales from the finite values only). NaN then stays visible
downstream instead of turning into a plausible number.
"""
from __future__ import annotations

import math
import weakref
from enum import Enum
from typing import Any, Callable, ClassVar, Sequence

import torch

from ..errors import VizqError

Tensor = torch.Tensor
Score = Callable[[Tensor, Tensor], Tensor]

class Granularity(str, Enum):
    """How many parameter sets a quantizer keeps: one per tensor, one per index along an axis,
    or one per block of consecutive values (MX, NVFP4). A value, not a string: a misspelt
    granularity fails where it is named, and ``scope`` says which of the three it is. It is a
    ``str`` enum, so configurations and exports keep writing the plain names."""

    TENSOR = "tensor"
    CHANNEL = "channel"  # last dim: features of a token
    TOKEN = "token"  # one parameter set per token position
    HEAD = "head"  # attention heads of a [B, H, N, N] or [B, H, N, D] tensor
    OUT_CHANNEL = "out_channel"  # weights: one parameter set per output channel (row of W)
    BLOCK = "block"  # block formats: set by the format's block size, not chosen as an option

    @property
    def axis(self) -> int | None:
        """The grouping axis (None: the whole tensor, or blocks)."""
        return {"channel": -1, "token": -2, "head": 1, "out_channel": 0}.get(self.value)

    @property
    def scope(self) -> str:
        return {"tensor": "per-tensor", "block": "per-block"}.get(self.value, "per-axis")


#: Granularity name -> grouping axis for the granularities a quantizer's option may name.
GRANULARITY_AXES: dict[str, int | None] = {g.value: g.axis for g in Granularity if g is not Granularity.BLOCK}

#: Searches look at most this many values per group: enough for stable error estimates,
#: small enough to keep a live comparison interactive.
SEARCH_SAMPLE = 1 << 14


class QuantizerError(VizqError, ValueError):
    """Bad quantizer name, option, bit width or input; the message says how to fix it."""


class Quantizer:
    """Base class. Subclasses set ``name``, ``bit_range``, ``defaults`` and implement the hooks."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    bit_range: ClassVar[tuple[int, int]] = (2, 8)
    defaults: ClassVar[dict[str, Any]] = {}
    choices: ClassVar[dict[str, tuple]] = {}
    description: ClassVar[str] = ""

    def __init__(self, bits: int = 4, **options: Any) -> None:
        lo, hi = self.bit_range
        if not isinstance(bits, int) or isinstance(bits, bool) or not lo <= bits <= hi:
            raise QuantizerError(
                f"{self.name}: bits={bits!r} is out of range; this quantizer supports {lo}..{hi} bits"
            )
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise QuantizerError(
                f"{self.name}: unknown option(s) {unknown}; valid options are {sorted(self.defaults)}"
            )
        self.bits = bits
        self.options: dict[str, Any] = {**self.defaults, **options}
        for key, allowed in self.choices.items():
            if self.options[key] not in allowed:
                raise QuantizerError(
                    f"{self.name}: option {key}={self.options[key]!r} is not one of {list(allowed)}"
                )
        gran = self.options.get("granularity", "tensor")
        if gran not in GRANULARITY_AXES:
            raise QuantizerError(
                f"{self.name}: granularity={gran!r} is unknown; use one of {list(GRANULARITY_AXES)}"
            )
        if "granularity" in self.options:
            self.options["granularity"] = Granularity(gran).value  # a Granularity member is stored by name
        self.state: dict[str, Tensor] = {}
        self._score: Score | None = None
        self.axis: int | None = None  # normalised (negative) grouping axis once calibrated

    # ----------------------------------------------------------------- public API
    @property
    def calibrated(self) -> bool:
        return bool(self.state)

    def calibrate(self, x: Tensor, score: Score | None = None) -> "Quantizer":
        """Fix the parameters from ``x`` (any shape); returns self for chaining.

        ``score(x_hat, x) -> [K, G]`` replaces the tensor MSE in searches, e.g. with the error
        of the layer the tensor feeds (AdaLog's FPCS); searches run on [K, G, M] candidates.
        """
        x = _check_input(self.name, x)
        self.axis = self._axis_for(x)
        groups = self._groups(x)
        self._score = score
        try:
            fitted = self._fit(groups)
        finally:
            self._score = None
        self.state = {k: v.detach().float().contiguous() for k, v in fitted.items()}
        return self

    def fake_quant(self, x: Tensor) -> Tensor:
        """Quantize then dequantize: same shape and dtype as ``x``."""
        if not self.calibrated:
            raise QuantizerError(f"{self.name}: call calibrate(x) before fake_quant(x)")
        if not torch.is_tensor(x):
            raise QuantizerError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        dtype = x.dtype
        xf = x.float()
        p = {k: self._view(v, xf) for k, v in self.state.items()}
        nan = torch.isnan(xf)
        if bool(nan.any()):  # see the module docstring: NaN in, NaN out, neighbours unchanged
            return self._apply(xf.masked_fill(nan, 0.0), p).masked_fill(nan, float("nan")).to(dtype)
        return self._apply(xf, p).to(dtype)

    def levels(self) -> Tensor:
        """Representable values: 1-D for one group, [groups, levels] otherwise (sorted)."""
        if not self.calibrated:
            raise QuantizerError(f"{self.name}: call calibrate(x) before levels()")
        lv = self._levels(self.state)
        return lv[0] if lv.shape[0] == 1 and self.axis is None else lv

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description; floats survive a JSON round trip exactly."""
        return {
            "name": self.name,
            "bits": self.bits,
            "options": dict(self.options),
            "axis": self.axis,
            "state": {k: {"shape": list(v.shape), "data": v.flatten().tolist()} for k, v in self.state.items()},
        }

    def to(self, device: torch.device | str) -> "Quantizer":
        self.state = {k: v.to(device) for k, v in self.state.items()}
        return self

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}(bits={self.bits}, {opts})"

    @property
    def granularity(self) -> Granularity:
        """The parameter sharing this quantizer uses (``BLOCK`` for block formats)."""
        if "block_size" in self.options:
            return Granularity.BLOCK
        return Granularity(self.options.get("granularity", "tensor"))

    # ----------------------------------------------------------------- grouping helpers
    def _axis_for(self, x: Tensor) -> int | None:
        axis = GRANULARITY_AXES[self.options.get("granularity", "tensor")]
        if axis is None:
            return None
        if x.dim() < 2 or not -x.dim() <= axis < x.dim():
            raise QuantizerError(
                f"{self.name}: granularity {self.options['granularity']!r} needs a tensor with more dims "
                f"than {tuple(x.shape)}; use granularity='tensor'"
            )
        return axis - x.dim() if axis >= 0 else axis

    def _groups(self, x: Tensor) -> Tensor:
        """[G, M] view: one row per parameter group."""
        if self.axis is None:
            return x.reshape(1, -1)
        return x.movedim(self.axis, 0).reshape(x.shape[self.axis], -1)

    def _view(self, p: Tensor, x: Tensor) -> Tensor:
        """Broadcast a per-group parameter [G] (or [G, k]) against ``x``."""
        p = p.to(x.device)
        if p.dim() == 0:
            return p
        if self.axis is None:
            return p.reshape(()) if p.numel() == 1 else p  # multi-valued state (block formats) as is
        trailing = -self.axis - 1
        if p.shape[0] != x.shape[self.axis]:
            raise QuantizerError(
                f"{self.name}: calibrated for {p.shape[0]} groups on axis {self.axis}, "
                f"got a tensor with {x.shape[self.axis]} there; recalibrate on this site"
            )
        return p.reshape(p.shape[0], *([1] * trailing))

    # ----------------------------------------------------------------- subclass hooks
    def _fit(self, g: Tensor) -> dict[str, Tensor]:
        """Parameters from the [G, M] groups; each value has leading dim G."""
        raise NotImplementedError

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        """[G, L] representable values (parameters un-broadcast, leading dim G)."""
        raise NotImplementedError


def _check_input(name: str, x: Tensor) -> Tensor:
    if not torch.is_tensor(x):
        raise QuantizerError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.numel() == 0:
        raise QuantizerError(f"{name}: cannot calibrate on an empty tensor; capture at least one image first")
    x = x.detach().float()
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise QuantizerError(f"{name}: input has {bad} non-finite values (NaN/inf); clean the tensor first")
    return x


#: Values kept exactly at each end of a group in a search sample: the tails (a few hundred
#: massive activations among millions) decide range searches, so they are never sampled away.
TAIL_KEEP = 1 << 10


def _stride(m: int, n: int) -> int:
    """The smallest prime >= m / n: a systematic sample with a prime stride visits every
    channel and token of a [B, N, C] layout (it shares no factor with C or N)."""
    s = max(1, m // n)
    while s > 2 and any(s % d == 0 for d in range(2, int(s**0.5) + 1)):
        s += 1
    return s


def search_sample(g: Tensor, n: int = SEARCH_SAMPLE) -> tuple[Tensor, Tensor | None]:
    """A deterministic, tail-exact sample of [G, M] groups for error searches, and its weights.

    Groups of at most ``n`` values are used whole (weights None). Larger ones keep their
    ``TAIL_KEEP`` smallest and largest values exactly (weight 1) plus a systematic sample of
    the values between them (prime stride, weight = how many values each stands for). No
    random seed is involved: the same tensor always gives the same sample, and a handful of
    outliers can never be missed (a seeded 16k subsample missed 125 massive activations of
    4.8 M values in ViT-Ti's block 7 and turned a range decision around).
    """
    m = g.shape[1]
    if m <= n:
        return g, None
    key = (g.data_ptr(), tuple(g.shape), tuple(g.stride()), g._version, g.dtype, n)
    storage = g.untyped_storage()
    last = _LAST_SAMPLE[0]  # read once: a dashboard thread may replace it meanwhile
    if last is not None and last[0] == key and last[1]() is storage:
        return last[2]  # the lab's quantizers sample one tensor in turn
    out = _tail_sample(g, n)
    _LAST_SAMPLE[0] = (key, weakref.ref(storage), out)
    return out


#: (key, weak reference to the storage, sample) of the last tensor sampled. The same live
#: storage at the same offset, shape, strides and in-place version counter holds the same
#: values, so a second search on it skips the two topk. The storage check is what makes the
#: address a safe key: an address alone is reused by the allocator once a tensor is freed,
#: and sequential calibration frees each site's tensor before it captures the next one of the
#: same shape (blocks.0.attn.k was searched on blocks.0.attn.q's sample that way, at random,
#: in about one ptq4vit-mse calibration of two). A weak reference keeps no memory alive; torch
#: keeps one Python object per live storage, so ``is`` fails once the old storage is gone.
_LAST_SAMPLE: list[Any] = [None]


def _tail_sample(g: Tensor, n: int) -> tuple[Tensor, Tensor | None]:
    m = g.shape[1]
    k = TAIL_KEEP
    lo = g.topk(k, 1, largest=False).values
    hi = g.topk(k, 1, largest=True).values
    step = _stride(m, n - 2 * k)
    mid = g[:, ::step]
    inside = (mid > lo[:, -1:]) & (mid < hi[:, -1:])  # strictly between the kept tails
    count_inside = inside.sum(1, keepdim=True).clamp_min(1)
    n_between = (g > lo[:, -1:]).logical_and(g < hi[:, -1:]).sum(1, keepdim=True)
    w_mid = torch.where(inside, n_between / count_inside, torch.zeros_like(mid))
    x = torch.cat([lo, mid, hi], 1)
    w = torch.cat([torch.ones_like(lo), w_mid, torch.ones_like(hi)], 1)
    return x, w / w.sum(1, keepdim=True)


def grid_search(
    g: Tensor,
    candidates: dict[str, Tensor],
    quantize: Callable[[Tensor, dict[str, Tensor]], Tensor],
    score: Callable[[Tensor, Tensor], Tensor] | None = None,
    budget: int = 1 << 23,
    exact: bool = False,
) -> dict[str, Tensor]:
    """Pick, per group, the candidate parameter set with the lowest error.

    ``candidates`` maps parameter names to [K, G] tensors. ``quantize(x[None], params[K, G, 1])``
    must broadcast to [K, G, M]. Candidates are evaluated in chunks so memory stays near
    ``budget`` floats whatever K is. ``score(xq, x)`` returns [K, G] (default: MSE, on the
    whole groups with ``exact`` — what the papers' code does — else on :func:`search_sample`).
    Ties go to the first candidate, as in the reference loops (``if score < best``).
    """
    k = next(iter(candidates.values())).shape[0]
    x, w = (g, None) if score or exact else search_sample(g)  # a custom score needs the full, ordered tensor
    chunk = max(1, budget // max(1, x.numel()))
    errs = []
    for start in range(0, k, chunk):
        params = {n: c[start : start + chunk].unsqueeze(-1) for n, c in candidates.items()}
        xq = quantize(x.unsqueeze(0), params)
        if score:
            errs.append(score(xq, x))
        elif w is None:
            errs.append((xq - x).pow_(2).mean(-1))  # = the reference's |d|^2, bit for bit
        else:
            errs.append(((xq - x).pow(2) * w).sum(-1))
    err = torch.cat(errs, 0)  # [K, G]
    best = err.argmin(0)  # [G]
    cols = torch.arange(best.numel(), device=best.device)
    return {n: c[best, cols] for n, c in candidates.items()}


def quantiles(g: Tensor, probs: Sequence[float]) -> Tensor:
    """[K, G]: the ``probs`` quantiles of each group, exactly as ``torch.quantile`` (linear
    interpolation, ranks computed in the data's float32) computes them on the whole group, but
    from the tails alone (``topk``), so a 0.99999 quantile of 5 M values costs no full sort.
    Above 2^24 values, where ``torch.quantile`` refuses and the papers' code falls back to
    ``numpy.percentile``, ranks and interpolation are in float64 as numpy does."""
    m = g.shape[1]
    big = m > 1 << 24
    dt = torch.float64 if big else g.dtype
    # torch.quantile: q in the data's dtype, rank = q * (m - 1) in double, weight back in float32
    q = torch.tensor(list(probs), dtype=dt, device=g.device).double()
    ranks = q * (m - 1)
    below = ranks.floor().long()
    above = ranks.ceil().long()
    weight = (ranks - below.double()).to(dt)
    upper = below >= (m - 1) // 2  # upper-half ranks are read from the top tail, the others from the bottom
    need_hi = int(m - below[upper].min()) if bool(upper.any()) else 0  # largest values needed
    need_lo = int(above[~upper].max()) + 1 if bool((~upper).any()) else 0  # smallest values needed
    if max(need_hi, need_lo) >= m // 4:
        srt = g.sort(1).values
        vb, va = srt[:, below], srt[:, above]
    else:
        top = g.topk(max(need_hi, 1), 1, largest=True).values  # descending: rank r is top[m-1-r]
        bot = g.topk(max(need_lo, 1), 1, largest=False).values  # ascending: rank r is bot[r]

        def at(r: Tensor) -> Tensor:
            from_top = (m - 1 - r).clamp(0, top.shape[1] - 1)
            from_bot = r.clamp(0, bot.shape[1] - 1)
            return torch.where(upper[None], top[:, from_top], bot[:, from_bot])

        vb, va = at(below), at(above)
    vb, va = vb.to(dt), va.to(dt)
    if big:  # numpy's _lerp
        w = weight[None].expand_as(vb)
        out = torch.where(w >= 0.5, va - (va - vb) * (1 - w), vb + (va - vb) * w)
    else:
        out = torch.lerp(vb, va, weight[None].expand_as(vb))
    return out.to(g.dtype).T


def table_lookup(table: Tensor, codes: Tensor) -> Tensor:
    """Dequantize integer ``codes`` through a per-parameter-set level table.

    ``table`` is [*P, L] where P is the (broadcast) shape of the parameters; ``codes`` broadcasts
    with P. Reading every value from one table keeps outputs bit-identical to ``levels()``;
    evaluating exp2/tan elementwise instead can differ by an ulp between vector and scalar code.
    """
    lead, n = table.shape[:-1], table.shape[-1]
    if lead and lead[-1] == 1 and codes.dim() == len(lead):
        # the [..., 1] parameter convention: one gather along the levels, no flat index
        # arithmetic in int64 (3x faster on the range searches' [K, G, M] candidates)
        t = table.squeeze(-2)
        shape = torch.broadcast_shapes(t.shape[:-1], codes.shape[:-1])
        return torch.gather(t.expand(*shape, n), -1, codes.long().expand(*shape, codes.shape[-1]))
    gidx = torch.arange(max(1, lead.numel()), device=table.device).reshape(lead) if lead else torch.tensor(0)
    return table.reshape(-1)[gidx * n + codes.long()]


def log2_safe(x: Tensor) -> Tensor:
    """log2 that maps 0 to a large negative number instead of -inf."""
    return torch.log2(x.clamp_min(torch.finfo(torch.float32).tiny))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


SQRT2 = math.sqrt(2.0)
