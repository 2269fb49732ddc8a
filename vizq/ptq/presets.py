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
from .catalog import GELU_SHIFT, OUTPUT_SCORED, PATCH_INPUT_BITS, PRESETS, QUANTIZED_ACT_KINDS, Preset, presets_for
from .config import ConfigError, QuantConfig, Rule

__all__ = ["GELU_SHIFT", "OUTPUT_SCORED", "PATCH_INPUT_BITS", "PRESETS", "QUANTIZED_ACT_KINDS", "Preset", "Spec",
           "check_modality", "plan", "presets_for"]


@dataclass(frozen=True)
class Spec:
    """The resolved quantizer for one site."""

    quantizer: str
    bits: int
    options: dict[str, Any] = field(default_factory=dict)
    shift: float = 0.0  # quantize x + shift, then subtract it (bias folding)

    def to_dict(self) -> dict[str, Any]:
        return {"quantizer": self.quantizer, "bits": self.bits, "options": dict(self.options), "shift": self.shift}


def _bits_for(quantizer: str, requested: int) -> int:
    """The one bits rule (``vizq.quant.registry.bits_for``, as in the lab and the CLI): a fixed-width
    format keeps its width; a quantizer whose range lacks ``requested`` is an error, never a
    silent clamp (a W10A10 repq would otherwise run its log√2 softmax at 8 bits unannounced)."""
    from ..quant import QuantizerError, quantizer_class
    from ..quant.registry import bits_for

    try:
        return bits_for(quantizer_class(quantizer), requested)
    except QuantizerError as e:
        raise ConfigError(f"{e} (asked for by this configuration's bit widths or overrides)") from None


def _matches(rule: Rule, site: Site) -> bool:
    return site.kind == rule.target if rule.is_kind else fnmatch.fnmatchcase(site.name, rule.target)


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
    for rule in config.rules():
        key = rule.target
        hit = [s for s in sites if _matches(rule, s)]
        if not hit:
            close = close_names(key, names)
            what = "site kind" if rule.is_kind else "pattern"
            hint = f"; close site names: {', '.join(close)}" if close else "; list them with `python -m vizq sites`"
            raise ConfigError(f"override {key!r}: this {what} matches no site of the model{hint}")
        gran = (rule.options or {}).get("granularity")
        for s in hit:
            if gran is not None and gran not in GRANULARITIES.get(s.kind, ("tensor",)):
                raise ConfigError(f"override {key!r}: granularity={gran!r} cannot apply to {s.name} ({s.kind}); "
                                  f"use one of {', '.join(GRANULARITIES.get(s.kind, ('tensor',)))}")


def check_modality(config: QuantConfig, modality: str) -> None:
    """A preset made for one kind of model fails on another before any work, naming the ones
    that apply (ptq4vit's Hessian metric needs a classifier's softmax; a text encoder has none)."""
    if modality not in PRESETS[config.preset].modalities:
        raise ConfigError(f"preset {config.preset!r} applies to {' and '.join(PRESETS[config.preset].modalities)} "
                          f"models, not {modality} ones; use one of {', '.join(presets_for(modality))}")


def plan(config: QuantConfig, sites: list[Site]) -> dict[str, Spec | None]:
    """Resolve every site to a :class:`Spec` (or None: left in floating point)."""
    check_overrides(config, sites)
    preset = PRESETS[config.preset]
    out: dict[str, Spec | None] = {}
    rules = config.rules()
    for s in sites:
        spec: Spec | None
        if s.kind == "weight":
            q, opts = next((w for pat, w in preset.weight_rules if fnmatch.fnmatchcase(s.module, pat)), preset.weights)
            spec = Spec(q, _bits_for(q, config.wbits), dict(opts))
        elif s.kind in QUANTIZED_ACT_KINDS:
            q, opts = preset.acts.get(s.kind, preset.default_act)
            bits = config.abits
            patch = s.kind == "linear_in" and s.module.endswith("patch_embed.proj") and not preset.fixed_format
            if patch and preset.patch_input is None:
                spec = None  # the preset leaves the image input in float
            else:
                if patch:
                    (q, opts), bits = preset.patch_input, PATCH_INPUT_BITS
                spec = Spec(q, _bits_for(q, bits), dict(opts), preset.shifts.get(s.kind, 0.0))
        else:
            spec = None
        for rule in rules:
            if not _matches(rule, s):
                continue
            if rule.enabled is False:
                spec = None
                continue
            if spec is None and s.kind not in QUANTIZED_ACT_KINDS + ("weight",):
                continue  # residual sites are not quantized
            base = spec or Spec("uniform", config.abits if s.is_activation else config.wbits)
            q = rule.quantizer or base.quantizer
            opts = rule.options if rule.options is not None else (base.options if q == base.quantizer else {})
            bits = rule.bits if rule.bits is not None else (
                base.bits if q == base.quantizer else config.abits if s.is_activation else config.wbits)
            spec = Spec(q, _bits_for(q, bits), dict(opts), base.shift if q == base.quantizer else 0.0)
        out[s.name] = spec
    return out


def reparam_mode(config: QuantConfig) -> str:
    return config.reparam if config.reparam is not None else PRESETS[config.preset].reparam
