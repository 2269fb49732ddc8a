"""Name -> quantizer class. The CLI and the dashboard fill their choices from here."""
from __future__ import annotations

from typing import Any

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


def list_quantizers(family: str | None = None) -> list[str]:
    return [n for n, c in _REGISTRY.items() if family is None or c.family == family]


def quantizer_class(name: str) -> type[Quantizer]:
    if name not in _REGISTRY:
        raise QuantizerError(f"unknown quantizer {name!r}; choose one of: {', '.join(list_quantizers())}")
    return _REGISTRY[name]
