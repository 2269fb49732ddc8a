"""Errors a user can fix: the CLI prints them as one line, the dashboard as a message."""
from __future__ import annotations

from .capture import Cancelled
from .data import DataError
from .models import ModelLoadError
from .quant.base import QuantizerError

USER_ERRORS: tuple[type[BaseException], ...] = (
    ModelLoadError,
    DataError,
    QuantizerError,
    Cancelled,
    FileNotFoundError,
    ValueError,
    KeyError,
)


def message(e: BaseException) -> str:
    """The user-facing text of an error (KeyError's repr quotes are dropped)."""
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return str(e) or type(e).__name__
