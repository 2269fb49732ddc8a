"""Non-uniform quantizers for power-law data (post-Softmax probabilities, post-GELU tails).

All of them quantize a magnitude ``a >= 0``. With ``signed`` (``"auto"``: on when the
calibration data has negatives) one bit carries the sign and the rest the magnitude, so the
same quantizers can be compared on any site.

- ``log2`` (FQ-ViT): levels s·2^-c.
- ``logsqrt2`` (RepQ-ViT): levels s·2^(-c/2), computed as a shift plus a √2 factor on odd codes.
- ``adalog`` (AdaLog): base 2^(q/37) with integer q searched; shift + fixed-point table dequant.
- ``sulq`` (I&S-ViT): shift by η, uniform in log2(a + η); η searched. Level 0 is exactly 0.
- ``sulq_released`` (I&S-ViT's released code): shift by b, uniform in log2(a + b) over the data's
  log range, then rounded to an integer exponent: levels 2^k − b. b searched over 11 values.
- ``tanq`` (DopQ-ViT): a tan-companding grid; our reading of the paper (see docs below).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import SQRT2, Quantizer, QuantizerError, Tensor, grid_search, log2_safe, quantiles, table_lookup
from .registry import register

ADALOG_R = 37
PERCENTILES = (0.999, 0.9999, 0.99999)
ADALOG_TABLE_FRAC_BITS = 16


class MagnitudeQuantizer(Quantizer):
    """Shared sign handling: subclasses quantize magnitudes only."""

    family: ClassVar[str] = "log"
    defaults = {"granularity": "tensor", "signed": "auto"}
    choices = {"signed": ("auto", True, False)}

    @property
    def n_codes(self) -> int:
        """Magnitude codes available (one bit goes to the sign when signed)."""
        return 2 ** (self.bits - (1 if self.options["signed"] is True else 0))

    def _fit(self, g: Tensor) -> dict[str, Tensor]:
        if self.options["signed"] == "auto":
            self.options["signed"] = bool((g < 0).any())
        if self.options["signed"] and self.bits < 2:
            raise QuantizerError(f"{self.name}: signed data needs at least 2 bits")
        a = g.abs() if self.options["signed"] else g.clamp_min(0)
        amax = a.max(1).values.clamp_min(1e-12)
        self._groups_in_fit = g
        try:
            return self._fit_mag(a, amax)
        finally:
            del self._groups_in_fit

    def _search(self, candidates: dict[str, Tensor], exact: bool = False) -> dict[str, Tensor]:
        """Grid search on the signed groups being fitted, scored by MSE (on all values with
        ``exact``, else on a tail-keeping sample) or the caller's score."""
        return grid_search(self._groups_in_fit, candidates, self._apply, score=self._score, exact=exact)

    def _percentile_scales(self, a: Tensor) -> dict[str, Tensor]:
        """RepQ-ViT's search: the top level at the 0.999 / 0.9999 / 0.99999 quantile of the
        magnitudes, the one with the lowest MSE over the whole tensor (ties: the first)."""
        return self._search({"scale": quantiles(a, PERCENTILES).clamp_min(1e-12)}, exact=True)

    def _apply(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        if self.options["signed"]:
            return torch.sign(x) * self._mag(x.abs(), p)
        return self._mag(x.clamp_min(0), p)

    def _levels(self, p: dict[str, Tensor]) -> Tensor:
        mag = self._mag_levels(p)
        if self.options["signed"]:
            mag = torch.cat([-mag.flip(1), mag], 1)
        return torch.sort(mag, 1).values

    def _fit_mag(self, a: Tensor, amax: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def _mag(self, a: Tensor, p: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def _mag_levels(self, p: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError


def _scale_candidates(amax: Tensor, steps: int) -> Tensor:
    """[K, G] scales amax·2^(-j/4): the top level slides down in quarter octaves."""
    j = torch.arange(steps, dtype=torch.float32, device=amax.device)
    return amax[None] * torch.exp2(-j / 4)[:, None]


# ---------------------------------------------------------------- log2
def log2_codes(a: Tensor, s: Tensor, n: int, mult: float = 1.0) -> tuple[Tensor, Tensor]:
    """Codes round(-mult·log2(a/s)) clamped to [0, n-1], and the mask of values that become 0."""
    c = torch.round(-mult * log2_safe(a / s))
    zero = c >= n
    return c.clamp(0, n - 1), zero


@register
class Log2Quantizer(MagnitudeQuantizer):
    """FQ-ViT log2: levels s·2^-c, c = 0..2^b-1; codes past the last level mean 0."""

    name = "log2"
    description = "log2 (FQ-ViT): power-of-two levels"
    defaults = {**MagnitudeQuantizer.defaults, "method": "max"}
    choices = {**MagnitudeQuantizer.choices, "method": ("max", "mse", "percentile")}

    def _fit_mag(self, a: Tensor, amax: Tensor) -> dict[str, Tensor]:
        if self.options["method"] == "max":
            return {"scale": amax}
        if self.options["method"] == "percentile":
            return self._percentile_scales(a)
        return self._search({"scale": _scale_candidates(amax, 8)})

    def _mag(self, a: Tensor, p: dict[str, Tensor]) -> Tensor:
        c, zero = log2_codes(a, p["scale"], self.n_codes)
        return torch.where(zero, torch.zeros_like(a), p["scale"] * torch.exp2(-c))

    def _mag_levels(self, p: dict[str, Tensor]) -> Tensor:
        c = torch.arange(self.n_codes, dtype=torch.float32, device=p["scale"].device)
        lv = p["scale"][:, None] * torch.exp2(-c)[None]
        return torch.cat([torch.zeros_like(lv[:, :1]), lv], 1)


# ---------------------------------------------------------------- log√2
def logsqrt2_dequant(c: Tensor, s: Tensor) -> Tensor:
    """The hardware form: shift by ceil(c/2), times √2 on odd codes."""
    odd = torch.remainder(c, 2)
    return s * torch.exp2(-torch.ceil(c / 2)) * (1 + (SQRT2 - 1) * odd)


def logsqrt2_direct(c: Tensor, s: Tensor) -> Tensor:
    """The textbook form s·2^(-c/2); equal to :func:`logsqrt2_dequant` (tested)."""
    return s * torch.exp2(-c / 2)


@register
class LogSqrt2Quantizer(MagnitudeQuantizer):
    """RepQ-ViT log√2: half-octave levels. ``method``: ``percentile`` is RepQ-ViT's own search
    (top level at one of three high quantiles, MSE over everything); ``mse`` slides the top
    level down from the max in quarter octaves (8 candidates); ``max`` takes the max."""

    name = "logsqrt2"
    description = "log√2 (RepQ-ViT): half-octave levels, shift + √2 dequant"
    defaults = {**MagnitudeQuantizer.defaults, "method": "mse"}
    choices = {**MagnitudeQuantizer.choices, "method": ("max", "mse", "percentile")}

    def _fit_mag(self, a: Tensor, amax: Tensor) -> dict[str, Tensor]:
        if self.options["method"] == "max":
            return {"scale": amax}
        if self.options["method"] == "percentile":
            return self._percentile_scales(a)
        cands = _scale_candidates(amax, 8)
        return self._search({"scale": cands})

    def _mag(self, a: Tensor, p: dict[str, Tensor]) -> Tensor:
        c, zero = log2_codes(a, p["scale"], self.n_codes, mult=2.0)
        return torch.where(zero, torch.zeros_like(a), logsqrt2_dequant(c, p["scale"]))

    def _mag_levels(self, p: dict[str, Tensor]) -> Tensor:
        c = torch.arange(self.n_codes, dtype=torch.float32, device=p["scale"].device)
        lv = logsqrt2_dequant(c[None], p["scale"][:, None])
        return torch.cat([torch.zeros_like(lv[:, :1]), lv], 1)


# ---------------------------------------------------------------- AdaLog
def adalog_table(r: int = ADALOG_R, frac_bits: int = ADALOG_TABLE_FRAC_BITS) -> Tensor:
    """T[j] = 2^(-j/r) in unsigned fixed point with ``frac_bits`` fraction bits."""
    j = torch.arange(r, dtype=torch.float64)
    return (torch.round(torch.exp2(-j / r) * 2**frac_bits) / 2**frac_bits).float()


def released_table(bits: int, r: int = ADALOG_R) -> Tensor:
    """T[j] = 2^(-j/r) rounded to a multiple of 1/(2^(b+1) - 2), as AdaLog's released code
    builds its dequantization table for b-bit codes (in float64, stored as float32): a table
    as coarse as the codes, where the 16-bit one is what a hardware table would hold."""
    den = 4 * 2 ** (bits - 1) - 2
    return torch.tensor([round(2 ** (-j / r) * den) / den for j in range(r)], dtype=torch.float32)


@register
class AdaLogQuantizer(MagnitudeQuantizer):
    """AdaLog: adaptive base 2^(q/37), q searched coarse to fine; q = 37 is exactly log2.

    Dequantization is a shift by floor(c·q/37) and a lookup T[(c·q) mod 37] in a 16-bit
    fixed-point table, as the hardware would do it. Pass ``base_q`` to fix q instead of searching.
    """

    name = "adalog"
    description = "AdaLog: searched log base, shift + table dequant"
    #: ``table``: "fixed16" (2^(-j/37) in 16-bit fixed point) or "released" (the released
    #: code's table, rounded to 1/(2^(b+1) - 2), and its 1e-15 floor before the log)
    defaults = {**MagnitudeQuantizer.defaults, "base_q": None, "table": "fixed16"}
    choices = {**MagnitudeQuantizer.choices, "table": ("fixed16", "released")}

    def _fit_mag(self, a: Tensor, amax: Tensor) -> dict[str, Tensor]:
        g = amax.shape[0]
        fixed = self.options["base_q"]
        if fixed is not None:
            if not (isinstance(fixed, int) and 1 <= fixed <= 4 * ADALOG_R):
                raise QuantizerError(f"adalog: base_q must be an integer in 1..{4 * ADALOG_R}, got {fixed!r}")
            qs = torch.tensor([float(fixed)])
        else:
            qs = torch.arange(16, 80, 4, dtype=torch.float32)  # coarse pass
        s_cands = _scale_candidates(amax, 4)

        def search(qvals: Tensor) -> dict[str, Tensor]:
            kq, ks = qvals.numel(), s_cands.shape[0]
            cand = {
                "scale": s_cands.repeat(kq, 1),
                "base_q": qvals.to(amax.device).repeat_interleave(ks)[:, None].expand(kq * ks, g).contiguous(),
            }
            return self._search(cand)

        best = search(qs)
        if fixed is None:  # fine pass around each group's coarse optimum (FPCS-style)
            fine = torch.arange(-3, 4, dtype=torch.float32, device=amax.device)
            offs = (best["base_q"][None] + fine[:, None]).clamp(1, 4 * ADALOG_R)  # [7, G]
            ks = s_cands.shape[0]
            cand = {"scale": s_cands.repeat(fine.numel(), 1), "base_q": offs.repeat_interleave(ks, 0)}
            best = self._search(cand)
        return best

    def _codes(self, a: Tensor, p: dict[str, Tensor]) -> Tensor:
        """round(-log2(a/s)·37/q) clamped to [0, n]; code n (past the last level) means 0.
        In place after the first division: the range search runs this on [K, G, M] candidates."""
        floor = 1e-15 if self.options["table"] == "released" else torch.finfo(torch.float32).tiny
        c = (a / p["scale"]).clamp_min_(floor).log2_()  # = log2_safe(a / s)
        return c.neg_().mul_(ADALOG_R).div_(p["base_q"]).round_().clamp_(0, self.n_codes)

    def _dequant(self, c: Tensor, p: dict[str, Tensor]) -> Tensor:
        e = c * p["base_q"]
        shift = torch.floor(e / ADALOG_R)
        idx = (e - shift * ADALOG_R).long().clamp(0, ADALOG_R - 1)
        table = released_table(self.bits) if self.options["table"] == "released" else adalog_table()
        return p["scale"] * torch.exp2(-shift) * table.to(c.device)[idx]

    def _table(self, p: dict[str, Tensor]) -> Tensor:
        """[*P, n + 1]: the n levels as the hardware dequantizes them (shift + table), then 0.
        One gather per value instead of the shift/lookup arithmetic per value (same bits:
        the shift is an exact power of two and the rest is one IEEE product per level)."""
        c = torch.arange(self.n_codes, dtype=torch.float32, device=p["scale"].device)
        lv = self._dequant(c, {"scale": p["scale"][..., None], "base_q": p["base_q"][..., None]})
        return torch.cat([lv, torch.zeros_like(lv[..., :1])], -1)

    def _mag(self, a: Tensor, p: dict[str, Tensor]) -> Tensor:
        return table_lookup(self._table(p), self._codes(a, p))

    def _mag_levels(self, p: dict[str, Tensor]) -> Tensor:
        lv = self._table(p)
        return torch.cat([lv[:, -1:], lv[:, :-1]], 1)  # 0 first, then the levels


# ---------------------------------------------------------------- SULQ
ETA_RATIOS = torch.tensor([1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0])


@register
class SULQQuantizer(MagnitudeQuantizer):
    """I&S-ViT shift-uniform-log2: uniform steps of log2(a + η); levels η·(2^(cΔ) - 1).

    Level 0 is exactly 0 and the top level exactly the calibrated max, so the whole [0, max]
    range is covered; η (relative to the max) is searched by MSE.
    """

    name = "sulq"
    description = "SULQ (I&S-ViT): shift, then uniform in log2"

    def _fit_mag(self, a: Tensor, amax: Tensor) -> dict[str, Tensor]:
        eta = ETA_RATIOS.to(a.device)[:, None] * amax[None]
        delta = torch.log2(amax[None] / eta + 1) / (self.n_codes - 1)
        return self._search({"eta": eta, "delta": delta})

    def _table(self, p: dict[str, Tensor]) -> Tensor:
        c = torch.arange(self.n_codes, dtype=torch.float32, device=p["eta"].device)
        return p["eta"][..., None] * (torch.exp2(c * p["delta"][..., None]) - 1)

    def _mag(self, a: Tensor, p: dict[str, Tensor]) -> Tensor:
        c = torch.round(torch.log2(a / p["eta"] + 1) / p["delta"]).clamp(0, self.n_codes - 1)
        return table_lookup(self._table(p), c)

    def _mag_levels(self, p: dict[str, Tensor]) -> Tensor:
        return self._table(p)


SULQ_RELEASED_SHIFTS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.2, 0.5, 1.0)


def _log2_released(x: Tensor) -> Tensor:
    """log2 the way the released code takes it, ln(x) / ln(2) in float32 (not torch.log2:
    the two differ in the last bit for some x, which moves a rounding boundary)."""
    return torch.log(x) / torch.log(torch.tensor(2, dtype=x.dtype))


def _positive(width: Tensor) -> Tensor:
    """A log range of zero width (a constant group) would make the released code divide by
    zero and return NaN; any positive width then maps the single value to code 0, which is
    what a constant needs. Nonzero widths pass through untouched, so real data is bit-exact."""
    return torch.where(width > 0, width, torch.ones_like(width))


@register
class SULQReleasedQuantizer(MagnitudeQuantizer):
    """SULQ as I&S-ViT's released code computes it (``LogSqrt2Quantizer`` in zysxmu/IaS-ViT),
    which is not the paper's formula (``sulq``): the shift b (absolute, one of 11 values) is
    chosen by MSE with 2^bits codes over [min, max] of log2(a + b); the forward then divides that
    log range into 2^bits steps and clamps to 2^bits + 1 codes (the code's own mismatch,
    kept), and every code's log value is rounded to an integer exponent, so the levels are
    2^k − b. Kept bit for bit because a preset named after the released code must give its
    numbers (``ias-released``; checked side by side, README)."""

    name = "sulq_released"
    description = "SULQ as I&S-ViT's released code computes it: shifted log2, integer exponents"
    # The released code quantizes post-Softmax values only (log2 of a negative a + b is NaN
    # there): unsigned, negatives clamp to 0, so every output is one of the listed levels.
    defaults = {"granularity": "tensor", "signed": False}
    choices = {"signed": (False,)}

    def _fit_mag(self, a: Tensor, amax: Tensor) -> dict[str, Tensor]:
        n = self.n_codes
        best: dict[str, Tensor] | None = None
        best_err = torch.full((a.shape[0],), 1e10, device=a.device)
        for b in SULQ_RELEASED_SHIFTS:  # the code's loop: strictly better wins, ties keep the first
            y = _log2_released(a + b)
            hi, lo = y.max(1, keepdim=True).values, y.min(1, keepdim=True).values
            step = _positive(hi - lo) / (n - 1)
            c = torch.round((y - lo) / step).clamp(0, n - 1)
            xq = 2 ** torch.round(c * step + lo) - b
            err = (a - xq).abs().pow(2).mean(1)  # the code's lp_loss(x, x_q, reduction='all')
            better = err < best_err
            cand = {"shift": torch.full_like(err, b), "lo": lo[:, 0], "hi": hi[:, 0]}
            best = cand if best is None else {k: torch.where(better, cand[k], v) for k, v in best.items()}
            best_err = torch.where(better, err, best_err)
        return best

    def _mag(self, a: Tensor, p: dict[str, Tensor]) -> Tensor:
        return sulq_released(a, p["shift"], p["lo"], p["hi"], self.n_codes, round_=torch.round)

    def _mag_levels(self, p: dict[str, Tensor]) -> Tensor:
        n = self.n_codes
        c = torch.arange(n + 1, dtype=torch.float32, device=p["shift"].device)[None]
        step = (_positive(p["hi"] - p["lo"]) / n)[:, None]
        return torch.sort(2 ** torch.round(c * step + p["lo"][:, None]) - p["shift"][:, None], 1).values


def sulq_released(a: Tensor, shift: Tensor, lo: Tensor, hi: Tensor, n: int, round_=torch.round) -> Tensor:
    """The released forward, op for op; ``round_`` is plain rounding, or a straight-through
    rounding where a procedure trains through it (``ptq/ias.py``: the same ops, the same bits)."""
    y = _log2_released(a + shift)
    step = _positive(hi - lo) / n
    c = torch.clamp(round_((y - lo) / step), 0, n)
    return 2 ** round_(c * step + lo) - shift


# ---------------------------------------------------------------- TanQ
TANQ_ALPHAS = torch.linspace(0.05, 1.55, 31)


@register
class TanQQuantizer(MagnitudeQuantizer):
    """TanQ, as we read DopQ-ViT: levels s·tan(α·c/(L-1))/tan(α), companded rounding.

    The published mapping was not available to us. This grid runs from near-uniform (α → 0)
    to strongly log-like (α → π/2); α is searched. Compared with log2 it keeps far more levels
    near 1 (where the large, important attention weights are) while still refining near 0.
    """

    name = "tanq"
    description = "TanQ (DopQ-ViT, our reading): tan-companded grid"

    def _fit_mag(self, a: Tensor, amax: Tensor) -> dict[str, Tensor]:
        alpha = TANQ_ALPHAS.to(a.device)[:, None].expand(-1, amax.shape[0]).contiguous()
        scale = amax[None].expand_as(alpha).contiguous()
        return self._search({"scale": scale, "alpha": alpha})

    def _table(self, p: dict[str, Tensor]) -> Tensor:
        u = torch.arange(self.n_codes, dtype=torch.float32, device=p["scale"].device) / (self.n_codes - 1)
        al = p["alpha"][..., None]
        return p["scale"][..., None] * torch.tan(al * u) / torch.tan(al)

    def _mag(self, a: Tensor, p: dict[str, Tensor]) -> Tensor:
        u = torch.atan((a / p["scale"]).clamp(0, 1) * torch.tan(p["alpha"])) / p["alpha"]
        return table_lookup(self._table(p), torch.round(u * (self.n_codes - 1)))

    def _mag_levels(self, p: dict[str, Tensor]) -> Tensor:
        return self._table(p)

