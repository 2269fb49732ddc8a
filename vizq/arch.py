"""Explicit attention with named taps, so every operand of q·kᵀ and attn·v is a module output.

timm's attention computes q, k, v and the probabilities as local variables (or inside fused
SDPA, where the probabilities never exist). ``instrument(model)`` gives each attention module
an explicit, unfused forward in which q, k, v, the probabilities and the projection input pass
through identity *tap* modules. Taps have no parameters, so state dicts and outputs are
unchanged; capture hooks them, and the PTQ engine puts quantizers on them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from timm.layers.attention import Attention
from timm.models.swin_transformer import WindowAttention
from torch import nn

from .errors import InputError

TAPS = ("q", "k", "v", "softmax", "proj_in")


def _add_taps(m: nn.Module) -> None:
    for name in TAPS:
        if name == "softmax":
            if not isinstance(getattr(m, "softmax", None), nn.Softmax):
                m.add_module("softmax", nn.Softmax(dim=-1))
        elif not hasattr(m, name):
            m.add_module(name, nn.Identity())
    m.fused_attn = False


class TappedAttention(Attention):
    """timm ``Attention`` (ViT, DeiT) with taps; same parameters, same math, unfused."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask

        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q(self.q_norm(q)), self.k(self.k_norm(k))
        v = self.v(v)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = maybe_add_mask(attn, resolve_self_attn_mask(n, attn, attn_mask, is_causal))
        attn = self.attn_drop(self.softmax(attn))
        x = (attn @ v).transpose(1, 2).reshape(b, n, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(self.proj_in(x)))


class TappedWindowAttention(WindowAttention):
    """timm Swin ``WindowAttention`` with taps (relative position bias and shift mask kept)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b_, n, _ = x.shape
        qkv = self.qkv(x).reshape(b_, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k, v = self.q(q), self.k(k), self.v(v)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn + self._get_rel_pos_bias()
        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.view(-1, num_win, self.num_heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, n, n)
        attn = self.attn_drop(self.softmax(attn))
        x = (attn @ v).transpose(1, 2).reshape(b_, n, -1)
        return self.proj_drop(self.proj(self.proj_in(x)))


#: original class -> tapped subclass. Extend here for a new attention implementation.
TAPPED: dict[type, type] = {Attention: TappedAttention, WindowAttention: TappedWindowAttention}

def instrument(model: nn.Module, extra: Sequence[Callable[[nn.Module], int]] = ()) -> nn.Module:
    """Swap every known attention module to its tapped subclass, in place; returns the model.

    ``extra``: a model family's own instrumenters (each returns how many modules it tapped),
    passed by the family rather than registered here, so this module knows no family.
    Idempotent. Raises if the model has attention we do not know, since its softmax could
    not be observed.
    """
    found = 0
    for m in model.modules():
        if type(m) in TAPPED.values():
            found += 1
            continue
        cls = TAPPED.get(type(m))
        if cls is not None:
            m.__class__ = cls
            _add_taps(m)
            found += 1
    for fn in extra:
        found += fn(model)
    if found == 0:
        raise InputError(
            f"{type(model).__name__} has no attention module vizq knows "
            f"({', '.join(c.__name__ for c in TAPPED)}); supported families: ViT, DeiT, Swin"
        )
    return model
