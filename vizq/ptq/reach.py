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
def _run_until(model: nn.Module, path: str, register: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run ``model`` with ``register(module, got)`` hooking submodule ``path``; the hook appends
    what it wants to ``got`` and raises :class:`_Reached`."""
    got: list[Any] = []
    handle = register(model.get_submodule(path), got)
    try:
        model(*args, **kwargs)
    except _Reached:
        pass
    finally:
        handle.remove()
    if not got:
        raise RuntimeError(f"{path} was not reached by the forward pass")
    return got[0]


def _stop(got: list[Any], value: Any) -> None:
    got.append(value)
    raise _Reached


def call_of(model: nn.Module, path: str, *args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments submodule ``path`` is called with when ``model``
    runs on ``args``/``kwargs``; nothing after it runs."""
    return _run_until(model, path, lambda mod, got: mod.register_forward_pre_hook(
        lambda m, a, kw: _stop(got, (a, dict(kw))), with_kwargs=True), args, kwargs)


def output_of(model: nn.Module, path: str, *args: Any, **kwargs: Any) -> Any:
    """What submodule ``path`` returns when ``model`` runs on ``args``/``kwargs``; nothing after
    it runs."""
    return _run_until(model, path, lambda mod, got: mod.register_forward_hook(
        lambda m, a, out: _stop(got, out)), args, kwargs)
