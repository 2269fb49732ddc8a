"""Forwards that stop at a module: what a submodule receives or returns, without the rest.

GPTQ/GPTAQ and block reconstruction need one layer's or one block's tensors at a time; running
the network past that point costs as much again for nothing (for the first blocks, nearly the
whole network), so the forward ends there by an exception the caller catches.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Reached(Exception):
    """Ends a forward once the wanted module has been reached."""


@torch.no_grad()
def call_of(model: nn.Module, path: str, *args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments submodule ``path`` is called with when ``model``
    runs on ``args``/``kwargs``; nothing after it runs."""
    got: list[tuple[tuple, dict[str, Any]]] = []

    def hook(m: nn.Module, a: tuple, kw: dict[str, Any]) -> None:
        got.append((a, dict(kw)))
        raise _Reached

    handle = model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(*args, **kwargs)
    except _Reached:
        pass
    finally:
        handle.remove()
    if not got:
        raise RuntimeError(f"{path} was not reached by the forward pass")
    return got[0]


@torch.no_grad()
def output_of(model: nn.Module, path: str, *args: Any, **kwargs: Any) -> Any:
    """What submodule ``path`` returns when ``model`` runs on ``args``/``kwargs``; nothing after
    it runs."""
    got: list[Any] = []

    def hook(m: nn.Module, a: tuple, out: Any) -> None:
        got.append(out)
        raise _Reached

    handle = model.get_submodule(path).register_forward_hook(hook)
    try:
        model(*args, **kwargs)
    except _Reached:
        pass
    finally:
        handle.remove()
    if not got:
        raise RuntimeError(f"{path} was not reached by the forward pass")
    return got[0]
