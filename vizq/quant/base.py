"""The quantizer interface, granularity handling and the name registry.

A quantizer is a small stateful object: ``calibrate(x)`` fixes its parameters from data,
``fake_quant(x)`` maps values onto its grid (quantize, then dequantize), ``levels()`` lists the
representable values, and ``to_dict``/``from_dict`` round-trip it exactly. Parameters live in
``self.state`` as float32 tensors so export can write them to safetensors unchanged.
"""
from __future__ import annotations

import math
from typing import Any, Callable, ClassVar

import torch

Tensor = torch.Tensor
Score = Callable[[Tensor, Tensor], Tensor]

#: Granularity name -> grouping axis (None: one group for the whole tensor).
GRANULARITY_AXES: dict[str, int | None] = {
    "tensor": None,
    "channel": -1,  # last dim: features of a token
    "token": -2,  # one parameter set per token position
    "head": 1,  # attention heads of a [B, H, N, N] or [B, H, N, D] tensor
    "out_channel": 0,  # weights: one parameter set per output channel (row of W)
}

#: Searches look at most this many values per group: enough for stable error estimates,
#: small enough to keep a live comparison interactive.
SEARCH_SAMPLE = 1 << 14


class QuantizerError(ValueError):
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
        out = self._apply(xf, {k: self._view(v, xf) for k, v in self.state.items()})
        return out.to(dtype)

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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Quantizer":
        from .registry import get_quantizer

        q = get_quantizer(d["name"], bits=d["bits"], **d.get("options", {}))
        q.axis = d.get("axis")
        q.state = {
            k: torch.tensor(v["data"], dtype=torch.float32).reshape(v["shape"]) for k, v in d.get("state", {}).items()
        }
        return q

    def to(self, device: torch.device | str) -> "Quantizer":
        self.state = {k: v.to(device) for k, v in self.state.items()}
        return self

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}(bits={self.bits}, {opts})"

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


def subsample(g: Tensor, n: int = SEARCH_SAMPLE, seed: int = 0) -> Tensor:
    """A seeded column subsample of [G, M] groups, for searches (deterministic)."""
    if g.shape[1] <= n:
        return g
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.randperm(g.shape[1], generator=gen)[:n].to(g.device)
    return g[:, idx]


def grid_search(
    g: Tensor,
    candidates: dict[str, Tensor],
    quantize: Callable[[Tensor, dict[str, Tensor]], Tensor],
    score: Callable[[Tensor, Tensor], Tensor] | None = None,
    budget: int = 1 << 23,
) -> dict[str, Tensor]:
    """Pick, per group, the candidate parameter set with the lowest error.

    ``candidates`` maps parameter names to [K, G] tensors. ``quantize(x[None], params[K, G, 1])``
    must broadcast to [K, G, M]. Candidates are evaluated in chunks so memory stays near
    ``budget`` floats whatever K is. ``score(xq, x)`` returns [K, G] (default: MSE).
    """
    k = next(iter(candidates.values())).shape[0]
    x = g if score else subsample(g)  # a custom score may need the full, ordered tensor
    chunk = max(1, budget // max(1, x.numel()))
    errs = []
    for start in range(0, k, chunk):
        params = {n: c[start : start + chunk].unsqueeze(-1) for n, c in candidates.items()}
        xq = quantize(x.unsqueeze(0), params)
        errs.append(score(xq, x) if score else (xq - x).pow(2).mean(-1))
    err = torch.cat(errs, 0)  # [K, G]
    best = err.argmin(0)  # [G]
    cols = torch.arange(best.numel(), device=best.device)
    return {n: c[best, cols] for n, c in candidates.items()}


def table_lookup(table: Tensor, codes: Tensor) -> Tensor:
    """Dequantize integer ``codes`` through a per-parameter-set level table.

    ``table`` is [*P, L] where P is the (broadcast) shape of the parameters; ``codes`` broadcasts
    with P. Reading every value from one table keeps outputs bit-identical to ``levels()``;
    evaluating exp2/tan elementwise instead can differ by an ulp between vector and scalar code.
    """
    lead, n = table.shape[:-1], table.shape[-1]
    gidx = torch.arange(max(1, lead.numel()), device=table.device).reshape(lead) if lead else torch.tensor(0)
    return table.reshape(-1)[gidx * n + codes.long()]


def log2_safe(x: Tensor) -> Tensor:
    """log2 that maps 0 to a large negative number instead of -inf."""
    return torch.log2(x.clamp_min(torch.finfo(torch.float32).tiny))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


SQRT2 = math.sqrt(2.0)
