"""The quantizer zoo: ``get_quantizer(name, bits, **options)`` and ``list_quantizers()``.

Importing this package registers every quantizer family.
"""
from . import fp, logq, twin, uniform  # noqa: F401  (registration side effects)
from .base import GRANULARITY_AXES, Granularity, Quantizer, QuantizerError
from .registry import get_quantizer, list_quantizers, quantizer_class

__all__ = [
    "GRANULARITY_AXES",
    "Granularity",
    "Quantizer",
    "QuantizerError",
    "get_quantizer",
    "list_quantizers",
    "quantizer_class",
]
