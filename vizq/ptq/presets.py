"""Method presets: which quantizer each site kind gets, and whether post-LN scales are folded.

Quantized, as in the reference codes: the input and weight of every Linear (head included),
the patch-embed weight (its input at 8 bits), and both operands of q·kᵀ and attn·v.
Residual-stream sites are observed, not quantized.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from ..sites import Site
from .config import ConfigError, QuantConfig, is_kind_key

QUANTIZED_ACT_KINDS = ("post_ln", "post_softmax", "post_gelu", "q", "k", "v", "attn_proj_in", "linear_in")
GELU_SHIFT = 0.16997  # |min GELU|: AdaLog quantizes x + η and folds -Ŵη into fc2's bias
PATCH_INPUT_BITS = 8


@dataclass(frozen=True)
class Spec:
    """The resolved quantizer for one site."""

    quantizer: str
    bits: int
    options: dict[str, Any] = field(default_factory=dict)
    shift: float = 0.0  # quantize x + shift, then subtract it (bias folding)

    def to_dict(self) -> dict[str, Any]:
        return {"quantizer": self.quantizer, "bits": self.bits, "options": dict(self.options), "shift": self.shift}


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    acts: dict[str, tuple[str, dict[str, Any]]]  # kind -> (quantizer, options); others: default
    default_act: tuple[str, dict[str, Any]]
    weights: tuple[str, dict[str, Any]]
    reparam: str = "none"  # post-LN scale folding: none / mean / median
    fixed_format: bool = False  # FP formats: bit widths come from the format
    shifts: dict[str, float] = field(default_factory=dict)
    paper: str = ""
    patch_input: tuple[str, dict[str, Any]] = ("uniform", {"method": "minmax"})  # at PATCH_INPUT_BITS
    score_images: int | None = None  # output-scored searches: images of the batch they use (None: all)
    token_relative: bool = False  # output-scored Linear inputs: per-token relative error (massive activations)


_PCT = {"method": "percentile"}
_W_PC = ("uniform", {"granularity": "out_channel", "method": "percentile"})
_LN_PC = ("uniform", {"granularity": "channel", "method": "percentile"})

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("minmax", "per-tensor uniform min/max everywhere (naive baseline)", {},
               ("uniform", {"method": "minmax"}), ("uniform", {"method": "minmax"})),
        Preset("ptq4vit", "twin-uniform softmax and GELU, MSE-searched uniform elsewhere (no Hessian)",
               {"post_softmax": ("twin", {"mode": "softmax"}), "post_gelu": ("twin", {"mode": "gelu"})},
               ("uniform", {"method": "mse"}), ("uniform", {"granularity": "out_channel", "method": "mse"}),
               paper="PTQ4ViT (ECCV'22)"),
        Preset("repq", "RepQ-ViT as its released code does it: per-channel post-LN folded (mean scale, "
               "unrounded mean zero point), log√2 softmax, 0.999/0.9999/0.99999-quantile searches on whole tensors",
               {"post_ln": _LN_PC, "post_softmax": ("logsqrt2", _PCT)},
               ("uniform", _PCT), _W_PC, reparam="mean", paper="RepQ-ViT (ICCV'23)", patch_input=("uniform", _PCT)),
        Preset("repq+", "vizq's refinement of repq: post-GELU range chosen by the next Linear's output error "
               "per token (massive activations then get clipped instead of erasing every ordinary value), "
               "exact integer-zero-point fold, finer log√2 scale search",
               {"post_ln": _LN_PC, "post_softmax": ("logsqrt2", {"method": "mse"})},
               ("uniform", _PCT), _W_PC, reparam="mean_int", patch_input=("uniform", _PCT), token_relative=True),
        Preset("dopq", "TanQ softmax, post-LN folded with the median scale (MOSF), no reconstruction",
               {"post_ln": _LN_PC, "post_softmax": ("tanq", {})},
               ("uniform", _PCT), _W_PC, reparam="median", paper="DopQ-ViT", patch_input=("uniform", _PCT)),
        Preset("adalog", "AdaLog softmax and post-GELU (bias-shifted), searches scored on layer output",
               {"post_ln": _LN_PC, "post_softmax": ("adalog", {}), "post_gelu": ("adalog", {"signed": False})},
               ("uniform", _PCT), _W_PC, reparam="mean", shifts={"post_gelu": GELU_SHIFT}, paper="AdaLog (ECCV'24)",
               patch_input=("uniform", _PCT), score_images=8),
        Preset("ias", "SULQ softmax, per-channel post-LN folded (mean); optional block reconstruction",
               {"post_ln": _LN_PC, "post_softmax": ("sulq", {})},
               ("uniform", _PCT), _W_PC, reparam="mean", paper="I&S-ViT", patch_input=("uniform", _PCT)),
        Preset("fp8", "FP8 E4M3 activations (per-tensor scale) and weights (per-channel scale)", {},
               ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "out_channel"}), fixed_format=True),
        Preset("mxfp4", "OCP MXFP4 (32-value E2M1 blocks, power-of-two scales) everywhere", {},
               ("mxfp4", {}), ("mxfp4", {}), fixed_format=True),
        Preset("nvfp4", "NVFP4 (16-value E2M1 blocks, E4M3 scales) everywhere", {},
               ("nvfp4", {}), ("nvfp4", {}), fixed_format=True),
    )
}

#: Kinds whose searches are scored on the output of the operation they feed (AdaLog's FPCS;
#: for repq+, the post-GELU range: the error of fc2's output, not of its input).
OUTPUT_SCORED = {"adalog": ("post_softmax", "post_gelu"), "repq+": ("post_gelu",)}


def _bits_for(quantizer: str, requested: int) -> int:
    from ..quant import quantizer_class

    lo, hi = quantizer_class(quantizer).bit_range
    return min(max(requested, lo), hi)


def _matches(key: str, site: Site) -> bool:
    return site.kind == key if is_kind_key(key) else fnmatch.fnmatchcase(site.name, key)


#: Granularities that mean something for a site kind's tensor layout: [B, N, C] activations
#: group by channel or token, [B, H, N, ·] attention tensors also by head, [out, in] weights by
#: output (or input) channel. Anything else would group along a batch or spatial axis.
_TOKEN_GRAN = ("tensor", "channel", "token")
GRANULARITIES: dict[str, tuple[str, ...]] = {
    "weight": ("tensor", "out_channel", "channel"),
    **{k: _TOKEN_GRAN + ("head",) for k in ("post_softmax", "q", "k", "v")},
    **{k: _TOKEN_GRAN for k in ("post_ln", "post_gelu", "attn_proj_in", "linear_in")},
}


def check_overrides(config: QuantConfig, sites: list[Site]) -> None:
    """Every override must reach a site, and a granularity must fit the sites it reaches:
    both fail here, before calibration, naming the override (never a silent no-op)."""
    from ..sites import close_names

    names = [s.name for s in sites]
    for key, rule in config.overrides.items():
        hit = [s for s in sites if _matches(key, s)]
        if not hit:
            close = close_names(key, names)
            what = "site kind" if is_kind_key(key) else "pattern"
            hint = f"; close site names: {', '.join(close)}" if close else "; list them with `python -m vizq sites`"
            raise ConfigError(f"override {key!r}: this {what} matches no site of the model{hint}")
        gran = (rule.get("options") or {}).get("granularity")
        for s in hit:
            if gran is not None and gran not in GRANULARITIES.get(s.kind, ("tensor",)):
                raise ConfigError(f"override {key!r}: granularity={gran!r} cannot apply to {s.name} ({s.kind}); "
                                  f"use one of {', '.join(GRANULARITIES.get(s.kind, ('tensor',)))}")


def plan(config: QuantConfig, sites: list[Site]) -> dict[str, Spec | None]:
    """Resolve every site to a :class:`Spec` (or None: left in floating point)."""
    check_overrides(config, sites)
    preset = PRESETS[config.method]
    out: dict[str, Spec | None] = {}
    kind_rules = [(k, r) for k, r in config.overrides.items() if is_kind_key(k)]
    glob_rules = [(k, r) for k, r in config.overrides.items() if not is_kind_key(k)]
    for s in sites:
        spec: Spec | None
        if s.kind == "weight":
            q, opts = preset.weights
            spec = Spec(q, _bits_for(q, config.wbits), dict(opts))
        elif s.kind in QUANTIZED_ACT_KINDS:
            q, opts = preset.acts.get(s.kind, preset.default_act)
            bits = config.abits
            if s.kind == "linear_in" and s.module.endswith("patch_embed.proj") and not preset.fixed_format:
                (q, opts), bits = preset.patch_input, PATCH_INPUT_BITS
            spec = Spec(q, _bits_for(q, bits), dict(opts), preset.shifts.get(s.kind, 0.0))
        else:
            spec = None
        for key, rule in kind_rules + glob_rules:
            if not _matches(key, s):
                continue
            if rule.get("enabled") is False:
                spec = None
                continue
            if spec is None and s.kind not in QUANTIZED_ACT_KINDS + ("weight",):
                continue  # residual sites are not quantized
            base = spec or Spec("uniform", config.abits if s.is_activation else config.wbits)
            q = rule.get("quantizer", base.quantizer)
            opts = rule.get("options", base.options if q == base.quantizer else {})
            bits = rule.get("bits", base.bits if q == base.quantizer else config.abits if s.is_activation else config.wbits)
            spec = Spec(q, _bits_for(q, bits), dict(opts), base.shift if q == base.quantizer else 0.0)
        out[s.name] = spec
    return out


def reparam_mode(config: QuantConfig) -> str:
    return config.reparam if config.reparam is not None else PRESETS[config.method].reparam
