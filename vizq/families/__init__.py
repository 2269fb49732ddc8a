"""The model families vizq knows, in the order their ``matches`` are tried (first wins).

An explicit list, as ``vizq/quant/__init__.py`` is for quantizers: a new family is one module
exposing a :class:`vizq.family.Family` record plus one line here. timm matches every spec the
others leave, so it stays last.
"""
from __future__ import annotations

from ..family import Family
from .bert import BERT
from .digits import BUNDLED, DIGITS
from .timm_vit import REAL_DEFAULT, SUPPORTED_ARCHS, TIMM

FAMILIES: tuple[Family, ...] = (DIGITS, BERT, TIMM)

#: The specs the dashboard and CLI offer by name (each owned by its family).
__all__ = ["BUNDLED", "FAMILIES", "REAL_DEFAULT", "SUPPORTED_ARCHS"]
