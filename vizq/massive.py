"""Massive activations: a few values thousands of times larger than the rest of their tensor.

Real ViTs have them (ViT-Ti/16 augreg: 125 values up to ~128 among 4.8 M at the input of
``blocks.7.mlp.fc2``, where the median |x| is ~0.1). They sit in a few channels and a few tokens,
and they decide a range search on their own: keep them and the 4-bit step is ~8, so almost
every ordinary value rounds to zero; clip them and the error is concentrated in a handful of
tokens. Neither choice is "right" by the tensor's own MSE; the error of what the tensor feeds
is what matters. This module finds them (which sites, channels, tokens, how many, how large)
and measures what each range choice does to them, so the choice is a deliberate one.

A value is *massive* when ``|x| >= ratio * median(|x|)`` of its site's tensor (default ratio
1000, the order of magnitude used by Sun et al., "Massive activations in large language
models", 2024) and ``|x| >= min_abs``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from .capture import site_hooks
from .metrics import token_relative_output_error
from .sites import Site

Tensor = torch.Tensor
RATIO = 1000.0
MIN_ABS = 1e-3


@dataclass
class MassiveSite:
    """What was found at one site, over all images seen."""

    site: str
    kind: str
    values: int = 0  # how many values were seen
    count: int = 0  # how many were massive
    max_abs: float = 0.0
    median_abs: float = 0.0  # median |x| of the first batch (the reference for the ratio)
    channels: dict[int, int] = field(default_factory=dict)  # channel -> massive count
    tokens: dict[int, int] = field(default_factory=dict)  # token position -> massive count
    images: int = 0  # images in which at least one massive value occurred

    def row(self) -> dict[str, Any]:
        top_c = sorted(self.channels.items(), key=lambda kv: -kv[1])[:5]
        top_t = sorted(self.tokens.items(), key=lambda kv: -kv[1])[:5]
        return {"site": self.site, "kind": self.kind, "massive": self.count, "of_values": self.values,
                "max_abs": self.max_abs, "median_abs": self.median_abs,
                "max_over_median": self.max_abs / self.median_abs if self.median_abs else float("inf"),
                "images_with": self.images, "channels": ", ".join(f"{c}×{n}" for c, n in top_c),
                "tokens": ", ".join(f"{t}×{n}" for t, n in top_t)}


def massive_mask(x: Tensor, ratio: float = RATIO, min_abs: float = MIN_ABS, median: float | None = None) -> Tensor:
    """Boolean mask of the massive values of ``x`` (median |x| of ``x`` unless given)."""
    a = x.detach().abs().float()
    med = float(a.flatten().median()) if median is None else median
    return (a >= ratio * med) & (a >= min_abs)


def _accumulate(st: MassiveSite, x: Tensor, ratio: float, min_abs: float) -> None:
    a = x.detach().abs().float()
    if st.values == 0:
        st.median_abs = float(a.flatten()[:: max(1, a.numel() // (1 << 20))].median())
    mask = massive_mask(a, ratio, min_abs, st.median_abs)
    st.values += a.numel()
    st.max_abs = max(st.max_abs, float(a.max()))
    n = int(mask.sum())
    if n == 0:
        return
    st.count += n
    idx = mask.nonzero()
    for c, k in zip(*torch.unique(idx[:, -1], return_counts=True)):
        st.channels[int(c)] = st.channels.get(int(c), 0) + int(k)
    if x.dim() >= 3:  # [B, N, C]: token positions
        for t, k in zip(*torch.unique(idx[:, -2], return_counts=True)):
            st.tokens[int(t)] = st.tokens.get(int(t), 0) + int(k)
    st.images += int(torch.unique(idx[:, 0]).numel())


@torch.no_grad()
def find_massive(loaded: Any, images: Any, indices: list[int], sites: Iterable[Site] | None = None,
                 batch_size: int = 32, ratio: float = RATIO, min_abs: float = MIN_ABS, device: str = "cpu",
                 progress: Callable[[int, int, str], None] | None = None) -> list[MassiveSite]:
    """Stream ``images[indices]`` through the float model; per activation site, count and
    locate the massive values. Sites are returned most massive first (count, then ratio)."""
    watch = [s for s in (sites or loaded.sites) if s.is_activation and s.kind != "post_softmax"]
    found = {s.name: MassiveSite(s.name, s.kind) for s in watch}

    def on_tensor(site: Site, x: Tensor) -> None:
        _accumulate(found[site.name], x, ratio, min_abs)

    model = loaded.model.to(device)
    done = 0
    with site_hooks(model, watch, on_tensor):
        for xb, _, ids in loaded.iterate(images, indices, batch_size):
            model(xb.to(device))
            done += len(ids)
            if progress:
                progress(done, len(indices), f"scanning for massive activations: {done}/{len(indices)} images")
    out = [f for f in found.values() if f.values]
    out.sort(key=lambda f: (-f.count, -(f.max_abs / f.median_abs if f.median_abs else 0)))
    return out


def range_study(x: Tensor, weight: Tensor | None, bits: int, ratio: float = RATIO) -> list[dict[str, Any]]:
    """What each uniform range choice does to a tensor with massive values: the candidates of
    RepQ-ViT's search (0.999 / 0.9999 / 0.99999 quantiles) and min/max, each with the tensor's
    own MSE, the error of the next Linear's output (``x @ weight.T``, the task-aware error),
    how many massive values it clips and how many ordinary values it rounds to zero."""
    from .quant.base import quantiles
    from .quant.uniform import asym_params, uniform_asym

    g = x.detach().float().reshape(1, -1)
    mask = massive_mask(g, ratio)
    qmax = 2**bits - 1
    probs = (0.999, 0.9999, 0.99999)
    q = quantiles(g, [*probs, *(1.0 - p for p in probs)])
    cands = [(f"percentile {p}", q[len(probs) + i, 0], q[i, 0]) for i, p in enumerate(probs)]
    cands.append(("min/max", g.min(), g.max()))
    rows = []
    flat = x.detach().float()
    for name, lo, hi in cands:
        s, z = asym_params(lo.reshape(1), hi.reshape(1), qmax)
        xq = uniform_asym(flat, s, z, qmax)
        err = xq - flat
        row = {"range": name, "lo": float(lo), "hi": float(hi), "step": float(s),
               "mse": float(err.pow(2).mean()), "massive_clipped": int((mask.reshape(flat.shape) & (flat.abs() > hi.abs() + s / 2)).sum()),
               "ordinary_to_zero_pct": 100 * float(((xq == 0) & (flat != 0) & ~mask.reshape(flat.shape)).sum())
               / max(1, int((~mask).sum()))}
        if weight is not None:
            w = weight.detach().float()
            row["output_mse"] = float((err.reshape(-1, w.shape[1]) @ w.T).pow(2).mean())
            row["output_rel_per_token"] = float(token_relative_output_error(err[None], flat, w))
        rows.append(row)
    return rows


@torch.no_grad()
def site_tensor(loaded: Any, images: Any, indices: list[int], site: Site, batch_size: int = 32) -> Tensor:
    """The float model's tensor at ``site`` for ``images[indices]``, batches concatenated
    (what :func:`range_study` studies)."""
    kept: list[Tensor] = []
    with site_hooks(loaded.model, [site], lambda s, x: kept.append(x.detach().cpu())):
        for xb, _, _ in loaded.iterate(images, indices, batch_size):
            loaded.model(xb)
    return torch.cat(kept)


def consumer_weight(loaded: Any, site: Site) -> Tensor | None:
    """The weight of the Linear the site feeds (for output-aware errors), if any."""
    return loaded.model.get_submodule(site.consumers[0]).weight if site.consumers else None
