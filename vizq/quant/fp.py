"""Floating-point formats: scaled minifloats (FP8/FP6/FP4) and block-scaled MX / NVFP4.

Each element format is enumerated once as its sorted set of non-negative finite values, so
rounding is a table lookup with round-to-nearest-even on ties (even code = even mantissa)
and saturation at the largest finite value (OCP "satfinite"), never overflow to inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch

from . import native
from .base import Quantizer, QuantizerError, Tensor, ceil_div, grid_search
from .registry import register
from .step import StepFunction


@dataclass(frozen=True)
class FloatFormat:
    """A minifloat: exponent/mantissa widths, bias, and the largest finite value."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_value: float

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two not above max_value (OCP MX's emax_elem)."""
        return int(torch.floor(torch.log2(torch.tensor(self.max_value))).item())


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("e4m3", 4, 3, 7, 448.0),  # OCP E4M3FN: no inf, S.1111.111 is NaN
        FloatFormat("e5m2", 5, 2, 15, 57344.0),  # IEEE-like: exponent 31 is inf/NaN
        FloatFormat("e3m2", 3, 2, 3, 28.0),
        FloatFormat("e2m3", 2, 3, 1, 7.5),
        FloatFormat("e2m1", 2, 1, 1, 6.0),
    )
}


@lru_cache(maxsize=None)
def format_values(name: str) -> Tensor:
    """Sorted non-negative finite values of a format, in code order."""
    f = FORMATS[name]
    vals = []
    for e in range(2**f.ebits):
        for m in range(2**f.mbits):
            frac = m / 2**f.mbits
            v = frac * 2.0 ** (1 - f.bias) if e == 0 else (1 + frac) * 2.0 ** (e - f.bias)
            if v <= f.max_value:
                vals.append(v)
    return torch.tensor(vals, dtype=torch.float32)


def round_to_format(x: Tensor, name: str) -> Tensor:
    """Round to the nearest representable value, ties to even, saturating at ±max."""
    vals = format_values(name).to(x.device)
    a = x.abs()
    lo = (torch.searchsorted(vals, a.contiguous(), right=True) - 1).clamp(0, vals.numel() - 1)
    hi = (lo + 1).clamp(max=vals.numel() - 1)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.sign(x) * vals[torch.where(take_hi, hi, lo)]


@lru_cache(maxsize=None)
def format_step(name: str) -> StepFunction:
    """:func:`round_to_format` as an exact step function (for the compiled block kernel)."""
    v = format_values(name)
    step = StepFunction.fit(lambda t: round_to_format(t, name), torch.cat([-v, v]))
    assert step is not None, name  # rounding to a format is monotone
    return step


def pow2(e: Tensor) -> Tensor:
    """Exactly 2^e (float32) for integer e in [-149, 127], built from the bit pattern."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp_min(1) << 23
    sub = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, sub).view(torch.float32)


def floor_log2(a: Tensor) -> Tensor:
    """floor(log2(a)) for a > 0, exactly (float32 log2 rounds up just below powers of two)."""
    return torch.frexp(a).exponent - 1


class ScaledFloatQuantizer(Quantizer):
    """A minifloat with a scale so the calibrated |max| lands on the format's max.

    ``method``: ``max`` (amax → format max), ``mse`` (searched clip ratio), ``none`` (scale 1,
    the raw format).
    """

    family: ClassVar[str] = "float"
    fmt: ClassVar[str] = ""
    defaults = {"granularity": "tensor", "method": "max"}
    choices = {"method": ("max", "mse", "none")}

    def _fit(self, g: Tensor) -> dict[str, Tensor]:
        vmax = FORMATS[self.fmt].max_value
        amax = g.abs().max(1).values.clamp_min(1e-12)
        if self.options["method"] == "none":
            return {"scale": torch.ones_like(amax)}
        if self.options["method"] == "max":
            return {"scale": amax / vmax}
        ratios = torch.linspace(0.3, 1.0, 29, device=g.device)[:, None]
        return grid_search(g, {"scale": ratios * amax[None] / vmax}, self._apply)

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        return round_to_format(x / p["scale"], self.fmt) * p["scale"]

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        v = format_values(self.fmt).to(p["scale"].device)
        full = torch.cat([-v.flip(0)[:-1], v])  # ±, one zero
        return p["scale"][:, None] * full[None]


def _make_float(fmt_name: str, reg_name: str) -> type[ScaledFloatQuantizer]:
    f = FORMATS[fmt_name]
    cls = type(
        f"FP{f.bits}{fmt_name.upper()}Quantizer",
        (ScaledFloatQuantizer,),
        {
            "name": reg_name,
            "fmt": fmt_name,
            "bit_range": (f.bits, f.bits),
            "description": f"FP{f.bits} {fmt_name.upper()} (max {f.max_value:g}) with a scale",
            "__doc__": f"FP{f.bits} {fmt_name.upper()} minifloat with a per-tensor or per-channel scale.",
        },
    )
    return register(cls)


for _fmt, _name in (("e4m3", "fp8_e4m3"), ("e5m2", "fp8_e5m2"), ("e3m2", "fp6_e3m2"), ("e2m3", "fp6_e2m3"), ("e2m1", "fp4_e2m1")):
    _make_float(_fmt, _name)


# ---------------------------------------------------------------- block-scaled formats
def _blocks(x: Tensor, size: int) -> tuple[Tensor, int]:
    """[..., nblocks, size] view of the last dim, zero-padded; returns it and the pad length."""
    n = x.shape[-1]
    pad = ceil_div(n, size) * size - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, size), pad


def finite_amax(blocks: Tensor) -> Tensor:
    """Per-block max |x| over the finite values: ±inf saturate, they do not set the scale."""
    a = blocks.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(-1, keepdim=True)


def _need_dims(name: str, x: Tensor) -> None:
    if x.dim() == 0:
        raise QuantizerError(f"{name}: block formats group the last dimension; a 0-dim tensor has none "
                             "(reshape it to (1,) or use a per-tensor quantizer)")


class BlockFloatQuantizer(Quantizer):
    """Blocks of ``block_size`` values along the last dim share one scale.

    Scales are computed from the data at every call (dynamic, as the hardware does it); the
    calibration records the distinct block scales seen so ``levels()`` can be plotted.
    """

    family: ClassVar[str] = "float"
    element: ClassVar[str] = ""
    default_block: ClassVar[int] = 32
    defaults = {"block_size": None}

    @property
    def block_size(self) -> int:
        bs = self.options["block_size"] or self.default_block
        if not isinstance(bs, int) or bs < 1:
            raise QuantizerError(f"{self.name}: block_size must be a positive integer, got {bs!r}")
        return bs

    def block_scales(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _fit(self, g: Tensor) -> dict[str, Tensor]:
        raise AssertionError("block formats override calibrate")

    def calibrate(self, x: Tensor, score=None) -> "BlockFloatQuantizer":  # noqa: ANN001 - same signature as base
        from .base import _check_input

        x = _check_input(self.name, x)
        _need_dims(self.name, x)
        self.axis = None
        self.state = self._static_state(x)
        blocks, _ = _blocks(x, self.block_size)
        self.state["block_scales"] = torch.unique(self.block_scales(blocks)).float()
        return self

    def _static_state(self, x: Tensor) -> dict[str, Tensor]:
        return {"block_size": torch.tensor([float(self.block_size)])}

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        _need_dims(self.name, x)
        fast = self._native(x)
        if fast is not None:
            return fast
        blocks, pad = _blocks(x, self.block_size)
        scale = self.block_scales(blocks)
        out = (round_to_format(blocks / scale, self.element) * scale).reshape(*x.shape[:-1], -1)
        return out[..., : x.shape[-1]] if pad else out

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        v = format_values(self.element).to(p["block_scales"].device)
        full = torch.cat([-v.flip(0)[:-1], v])
        return torch.unique(p["block_scales"][:, None] * full[None])[None]

    def _native(self, x: Tensor) -> Tensor | None:
        """The compiled kernel's result (same bits), or None where it cannot run."""
        return None


class MXQuantizer(BlockFloatQuantizer):
    """OCP MX: 32-value blocks, shared E8M0 (power-of-two) scale 2^(floor(log2 amax) - emax)."""

    def block_scales(self, blocks: Tensor) -> Tensor:
        amax = finite_amax(blocks)
        e = floor_log2(amax.clamp_min(2.0**-127)) - FORMATS[self.element].emax
        return pow2(e.clamp(-127, 127))

    def _native(self, x: Tensor) -> Tensor | None:
        return native.block_apply(x, self.block_size, format_step(self.element), emax=FORMATS[self.element].emax)


def _make_mx(element: str, reg_name: str) -> None:
    f = FORMATS[element]
    register(
        type(
            f"MX{reg_name.upper()}Quantizer",
            (MXQuantizer,),
            {
                "name": reg_name,
                "element": element,
                "bit_range": (f.bits, f.bits),
                "description": f"{reg_name.upper()}: 32-value blocks of {element.upper()}, power-of-two scale",
            },
        )
    )


for _el, _name in (("e4m3", "mxfp8"), ("e2m3", "mxfp6"), ("e2m1", "mxfp4")):
    _make_mx(_el, _name)


@register
class NVFP4Quantizer(BlockFloatQuantizer):
    """NVFP4: 16-value blocks of E2M1, each with an E4M3 scale, under one FP32 tensor scale.

    The tensor scale maps the calibrated |max| to 448·6, so every block scale fits E4M3.
    """

    name = "nvfp4"
    element = "e2m1"
    default_block = 16
    bit_range = (4, 4)
    description = "NVFP4: 16-value E2M1 blocks, E4M3 block scale + FP32 tensor scale"

    def _static_state(self, x: Tensor) -> dict[str, Tensor]:
        amax = x.abs().max().clamp_min(1e-12)
        return {"block_size": torch.tensor([float(self.block_size)]), "tensor_scale": (amax / (448.0 * 6.0)).reshape(1)}

    def block_scales(self, blocks: Tensor) -> Tensor:
        ts = self.state["tensor_scale"].to(blocks.device)
        amax = finite_amax(blocks)
        s = round_to_format(amax / 6.0 / ts, "e4m3")  # an E4M3 value
        s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero block: any scale works
        return s * ts

    def _native(self, x: Tensor) -> Tensor | None:
        ts = self.state.get("tensor_scale")
        if ts is None:
            return None
        return native.block_apply(x, self.block_size, format_step(self.element), format_step("e4m3"),
                                  tensor_scale=float(ts))

    def e4m3_block_scales(self, x: Tensor) -> Tensor:
        """The block scales as stored (E4M3 values, before the tensor scale), for inspection."""
        blocks, _ = _blocks(x.float(), self.block_size)
        return self.block_scales(blocks) / self.state["tensor_scale"].to(x.device)
