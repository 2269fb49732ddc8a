"""Name -> quantizer class. The CLI and the dashboard fill their choices from here."""
from __future__ import annotations

from typing import Any

import torch

from .base import Quantizer, QuantizerError

_REGISTRY: dict[str, type[Quantizer]] = {}


def register(cls: type[Quantizer]) -> type[Quantizer]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"quantizer name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls
    return cls


def get_quantizer(name: str, bits: int | None = None, **options: Any) -> Quantizer:
    """A fresh, uncalibrated quantizer by registry name.

    ``bits=None`` takes the quantizer's default: 4 for integer/log grids, the format's own
    width for FP formats (8 for ``fp8_e4m3``).
    """
    cls = quantizer_class(name)
    return cls(bits=default_bits(cls) if bits is None else bits, **options)


def default_bits(cls: type[Quantizer]) -> int:
    lo, hi = cls.bit_range
    return lo if lo == hi else min(max(4, lo), hi)


#: Bit widths any quantizer can be asked for; each class narrows it with ``bit_range``.
BITS_LIMITS = (2, 16)


def bits_for(cls: type[Quantizer], requested: int) -> int:
    """The one rule for a requested bit width: outside 2..16 is an error; a fixed-width format
    (FP8, FP4, MX, NVFP4) keeps its own width, which the caller shows next to the result; a
    quantizer whose range does not hold ``requested`` is an error naming its range."""
    lo, hi = BITS_LIMITS
    if not isinstance(requested, int) or isinstance(requested, bool) or not lo <= requested <= hi:
        raise QuantizerError(f"bits={requested!r} is out of range; use {lo}..{hi}")
    clo, chi = cls.bit_range
    if clo == chi:
        return clo
    if not clo <= requested <= chi:
        raise QuantizerError(f"{cls.name} supports {clo}..{chi} bits, not {requested}; pick another width or quantizer")
    return requested


def list_quantizers(family: str | None = None) -> list[str]:
    return [n for n, c in _REGISTRY.items() if family is None or c.family == family]


def quantizer_class(name: str) -> type[Quantizer]:
    if name not in _REGISTRY:
        raise QuantizerError(f"unknown quantizer {name!r}; choose one of: {', '.join(list_quantizers())}")
    return _REGISTRY[name]


def quantizer_from_dict(d: dict[str, Any]) -> Quantizer:
    """A calibrated quantizer from :meth:`Quantizer.to_dict` (lives here, not on the class, so
    the base class never imports the registry)."""
    q = get_quantizer(d["name"], bits=d["bits"], **d.get("options", {}))
    q.axis = d.get("axis")
    q.state = {k: torch.tensor(v["data"], dtype=torch.float32).reshape(v["shape"]) for k, v in d.get("state", {}).items()}
    return q
