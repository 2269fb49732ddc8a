"""One door to every model: ``load_model(spec)``.

The spec picks the family (``vizq.families.FAMILIES``, first match wins): ``vizq-vit-tiny``
(the digits ViT in assets/), ``minilm-l6`` or a BERT folder (text), and otherwise a timm name
(see :mod:`vizq.families.timm_vit`: shipped real weights, the hub, ``random:``, ``NAME@FILE``).
Every model comes back in eval mode, instrumented (unfused attention with taps), with its
preprocessing, class names, metadata and its family record.
"""
from __future__ import annotations

from typing import Any

from .families import BUNDLED, FAMILIES, REAL_DEFAULT, SUPPORTED_ARCHS
from .family import Family, LoadedModel, ModelInfo, ModelLoadError, rows_of

__all__ = ["BUNDLED", "REAL_DEFAULT", "SUPPORTED_ARCHS", "Family", "LoadedModel", "ModelInfo", "ModelLoadError",
           "family_for", "list_models", "load_model"]


def family_for(spec: str) -> Family:
    return next(f for f in FAMILIES if f.matches(spec))


def load_model(spec: str, **kwargs: Any) -> LoadedModel:
    """Load ``spec`` (see module docstring). Extra kwargs go to the family loader
    (for timm: ``checkpoint=``, ``pretrained=``, ``img_size=`` and other create_model args)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"model spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    family = family_for(spec)
    if kwargs.get("checkpoint") and not family.takes_checkpoint:  # never ignore a checkpoint silently
        raise ModelLoadError(f"{spec} brings its own weights and takes no checkpoint; pass a timm architecture "
                             f"(e.g. --model vit_tiny_patch16_224 --checkpoint FILE) or drop --checkpoint")
    return family.load(spec, **kwargs)


def list_models() -> list[dict[str, str]]:
    """What can be loaded here and what needs weights first."""
    return rows_of(FAMILIES)
