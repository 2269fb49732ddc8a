"""Plotly figure builders: pure functions of data, tested without a browser.

Every builder returns ``(figure, table)``: the table (a DataFrame) is exactly what the figure
shows, so the dashboard can offer it as CSV next to the chart.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from .ptq.config import options_label
from .stats import log2_bin_edges

Figure = go.Figure
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]


def _layout(fig: Figure, title: str, x: str, y: str, **kw: Any) -> Figure:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, template="plotly_white",
                      margin={"l": 60, "r": 20, "t": 50, "b": 50}, legend={"orientation": "h", "y": -0.2}, **kw)
    return fig


# ---------------------------------------------------------------- softmax explorer
def softmax_log2_histogram(log_hist: torch.Tensor, heads: Sequence[int] | None = None, title: str = "") -> tuple[Figure, pd.DataFrame]:
    """Attention probabilities per log2 bin (one octave each), per head, to-CLS vs to-patches."""
    h = log_hist.shape[0]
    heads = list(range(h)) if heads is None else list(heads)
    edges = log2_bin_edges().numpy()
    labels = ["0"] + [f"2^{int(math.log2(e))}" for e in edges[:-1]]
    rows = []
    fig = go.Figure()
    for i, head in enumerate(heads):
        for part, name in ((0, "to CLS"), (1, "to patches")):
            counts = log_hist[head, part].numpy()
            if counts.sum() == 0:
                continue
            frac = counts / max(log_hist[head].sum().item(), 1)
            fig.add_bar(x=labels, y=frac, name=f"head {head} {name}", marker_color=PALETTE[i % len(PALETTE)],
                        opacity=1.0 if part else 0.55)
            rows += [{"head": head, "keys": name, "bin_lower_edge": lab, "count": int(c), "fraction": float(f)}
                     for lab, c, f in zip(labels, counts, frac)]
    fig.update_yaxes(type="log")
    _layout(fig, title or "post-Softmax probabilities, log2 bins", "probability bin (lower edge, octaves)",
            "fraction of probabilities (log scale)", barmode="group")
    return fig, pd.DataFrame(rows)


def ccdf_loglog(log_hist: torch.Tensor, tail: dict[str, float], title: str = "") -> tuple[Figure, pd.DataFrame]:
    """P(p ≥ x) on log-log axes with the least-squares power law of ``powerlaw_tail`` drawn
    over the range it was fitted on, and only where it is a probability (≤ 1)."""
    counts = log_hist.sum(dim=(0, 1)).double()
    total = float(counts.sum())
    x = log2_bin_edges()[:-1].double().numpy()
    ccdf = (torch.flip(torch.cumsum(torch.flip(counts[1:], [0]), 0), [0]) / total).numpy()
    keep = ccdf > 0
    df = pd.DataFrame({"x": x[keep], "ccdf": ccdf[keep]})
    fig = go.Figure(go.Scatter(x=df.x, y=df.ccdf, mode="lines+markers", name="measured CCDF"))
    alpha, c = tail.get("alpha", float("nan")), tail.get("log10_c", float("nan"))
    if math.isfinite(alpha) and math.isfinite(c):
        fit = 10.0 ** c * df.x ** (-alpha)
        df["fit"] = fit.where((df.x >= tail["fit_lo"]) & (df.x <= tail["fit_hi"]) & (fit <= 1.0))
        ref = df[df.fit.notna()]
        fig.add_scatter(x=ref.x, y=ref.fit, mode="lines", line={"dash": "dash"},
                        name=f"power-law fit, α = {alpha:.2f} (p in [2^{math.log2(tail['fit_lo']):.0f}, "
                             f"2^{math.log2(tail['fit_hi']):.0f}])")
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log", range=[math.log10(max(float(df.ccdf.min()), 1e-12)) - 0.2, 0.05])
    return _layout(fig, title or "CCDF of attention probabilities", "probability p (log)", "P(P ≥ p) (log)"), df


def attention_overlay(image: np.ndarray, attn_row: np.ndarray, grid: tuple[int, int], title: str = "") -> tuple[Figure, pd.DataFrame]:
    """The attention of one query over the patch grid, drawn over the input image."""
    gh, gw = grid
    a = attn_row[-gh * gw :].reshape(gh, gw)
    h, w = image.shape[:2]
    fig = go.Figure()
    fig.add_trace(go.Image(z=image))
    fig.add_trace(go.Heatmap(z=a, x0=w / gw / 2, dx=w / gw, y0=h / gh / 2, dy=h / gh, colorscale="Inferno", opacity=0.55,
                             colorbar={"title": "attention"}, hovertemplate="patch (%{y:.0f}, %{x:.0f}): %{z:.4f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", showticklabels=False)
    fig.update_xaxes(showticklabels=False)
    df = pd.DataFrame([{"patch_row": r, "patch_col": c, "attention": float(a[r, c])} for r in range(gh) for c in range(gw)])
    return _layout(fig, title or "attention over the image", "image x (pixels)", "image y (pixels)"), df


def key_mass_heatmap(masses: dict[str, torch.Tensor], prefix_tokens: int = 1) -> tuple[Figure, pd.DataFrame]:
    """Attention mass received per key token (rows: layers), log colour: sinks stand out."""
    names = list(masses)
    n = max(m.numel() for m in masses.values())
    z = np.full((len(names), n), np.nan)
    for i, k in enumerate(names):
        z[i, : masses[k].numel()] = masses[k].numpy()
    labels = [("CLS" if j < prefix_tokens else f"{j - prefix_tokens}") for j in range(n)]
    fig = go.Figure(go.Heatmap(z=np.log10(np.clip(z, 1e-8, None)), x=labels, y=names, colorscale="Viridis",
                               colorbar={"title": "log10 mass"},
                               hovertemplate="%{y}<br>key %{x}: 10^%{z:.2f}<extra></extra>"))
    df = pd.DataFrame(z, index=names, columns=labels).reset_index(names="layer")
    return _layout(fig, "attention sinks: mean mass each key token receives", "key token", "layer"), df


# ---------------------------------------------------------------- LayerNorm explorer
def channel_ranges(ch_min: torch.Tensor, ch_max: torch.Tensor, pct: dict[float, torch.Tensor] | None,
                   sort: bool = True, outlier_factor: float = 3.0, title: str = "") -> tuple[Figure, pd.DataFrame]:
    """Per-channel [min, max] bars with percentile whiskers; outlier channels in red."""
    lo, hi = ch_min.double().numpy(), ch_max.double().numpy()
    rng = hi - lo
    med = float(np.median(rng))
    df = pd.DataFrame({"channel": np.arange(lo.size), "min": lo, "max": hi, "range": rng})
    if pct:
        for p, v in pct.items():
            df[f"p{p:g}"] = v.double().numpy()
    df["outlier"] = df["range"] > outlier_factor * med
    if sort:
        df = df.sort_values("range", ascending=False)
    order = [str(c) for c in df.channel]
    colors = np.where(df.outlier, "#d62728", "#1f77b4")
    fig = go.Figure(go.Bar(x=order, y=df["max"] - df["min"], base=df["min"], marker_color=colors, name="min … max",
                           hovertemplate="channel %{x}<br>min %{base:.3f}<br>range %{y:.3f}<extra></extra>"))
    if pct and 0.1 in pct and 99.9 in pct:
        fig.add_scatter(x=order, y=df["p99.9"], mode="markers", marker={"symbol": "line-ew-open", "size": 8, "color": "#333"}, name="p99.9")
        fig.add_scatter(x=order, y=df["p0.1"], mode="markers", marker={"symbol": "line-ew-open", "size": 8, "color": "#777"}, name="p0.1")
    fig.update_xaxes(type="category", showticklabels=lo.size <= 96)
    return _layout(fig, title or f"per-channel ranges ({int(df.outlier.sum())} outlier channels > {outlier_factor:g}× median range)",
                   "channel" + (" (sorted by range)" if sort else ""), "activation value"), df


def variation_heatmap(rows: list[dict[str, Any]]) -> tuple[Figure, pd.DataFrame]:
    """Inter-channel variation (max/median channel range) per block × post-LN site."""
    df = pd.DataFrame(rows)
    piv = df.pivot_table(index="position", columns="block", values="variation", aggfunc="first")
    fig = go.Figure(go.Heatmap(z=piv.values, x=[str(c) for c in piv.columns], y=list(piv.index), colorscale="Reds",
                               colorbar={"title": "max/median"}, hovertemplate="block %{x}, %{y}: %{z:.2f}×<extra></extra>"))
    return _layout(fig, "inter-channel variation of post-LN outputs", "block", "post-LN site"), df


def reparam_preview(prev: dict[str, torch.Tensor], title: str = "") -> tuple[Figure, pd.DataFrame]:
    """Channel ranges before and after folding the per-channel scales into LayerNorm."""
    df = pd.DataFrame({k: v.numpy() for k, v in prev.items()})
    df.insert(0, "channel", np.arange(len(df)))
    df["before_range"] = df.before_max - df.before_min
    df["after_range"] = df.after_max - df.after_min
    df = df.sort_values("before_range", ascending=False)
    x = [str(c) for c in df.channel]
    fig = go.Figure()
    fig.add_bar(x=x, y=df.before_range, name="before folding", marker_color="#d62728", opacity=0.6)
    fig.add_bar(x=x, y=df.after_range, name="after folding", marker_color="#1f77b4")
    fig.update_xaxes(type="category", showticklabels=len(df) <= 96)
    return _layout(fig, title or "channel ranges before/after reparameterization", "channel (sorted by original range)",
                   "range max − min", barmode="overlay"), df


# ---------------------------------------------------------------- quantizer lab
def levels_over_histogram(x: torch.Tensor, levels: dict[str, torch.Tensor], log_x: bool = False,
                          bins: int = 120, title: str = "") -> tuple[Figure, pd.DataFrame]:
    """The tensor's histogram with each quantizer's levels as tick marks above it."""
    v = x.detach().double().flatten().numpy()
    if log_x:
        pos = v[v > 0]
        lo = max(float(pos.min()) if pos.size else 1e-8, 1e-8)
        edges = np.logspace(np.log10(lo), np.log10(max(float(v.max()), lo * 10)), bins + 1)
    else:
        edges = np.linspace(float(v.min()), float(v.max()) if v.max() > v.min() else float(v.min()) + 1, bins + 1)
    counts, _ = np.histogram(v, bins=edges)
    centers = np.sqrt(edges[:-1] * edges[1:]) if log_x else (edges[:-1] + edges[1:]) / 2
    fig = go.Figure(go.Bar(x=centers, y=np.maximum(counts, 0), width=np.diff(edges), name="values", marker_color="#bbb"))
    top = max(int(counts.max()), 1)
    rows = [{"series": "histogram", "x": float(c), "count": int(n)} for c, n in zip(centers, counts)]
    # The axis spans the data (a decade of margin on a log axis), never a level far outside it:
    # a log grid's smallest levels (1e-18 …) would squeeze the whole histogram into one pixel.
    lo_ax, hi_ax = float(edges[0]), float(edges[-1])
    lo_ax, hi_ax = (lo_ax / 10, hi_ax * 2) if log_x else (lo_ax - 0.05 * (hi_ax - lo_ax), hi_ax + 0.05 * (hi_ax - lo_ax))
    for i, (name, lv) in enumerate(levels.items()):
        lvv = np.unique(lv.detach().double().flatten().numpy())
        if log_x:
            lvv = lvv[lvv > 0]
        inside = lvv[(lvv >= lo_ax) & (lvv <= hi_ax)]
        off = lvv.size - inside.size
        y = top * 2.0 ** (1 + 0.7 * i)  # one row per quantizer (log axis: multiplicative spacing)
        fig.add_scatter(x=inside, y=np.full(inside.size, y), mode="markers",
                        name=f"{name} ({lvv.size} levels" + (f", {off} outside the data's range)" if off else ")"),
                        marker={"symbol": "line-ns-open", "size": 14, "color": PALETTE[i % len(PALETTE)], "line": {"width": 2}})
        rows += [{"series": name, "x": float(level), "count": None} for level in lvv]
    if log_x:
        fig.update_xaxes(type="log", range=[math.log10(lo_ax), math.log10(hi_ax)])
    else:
        fig.update_xaxes(range=[lo_ax, hi_ax])
    fig.update_yaxes(type="log")
    return _layout(fig, title or "histogram with quantization levels", "value" + (" (log)" if log_x else ""),
                   "count (log); level ticks above"), pd.DataFrame(rows)


def error_scatter(x: torch.Tensor, xq: dict[str, torch.Tensor], max_points: int = 4000, log: bool = False) -> tuple[Figure, pd.DataFrame]:
    """Quantized vs original value for a seeded sample of points, one trace per quantizer."""
    flat = x.detach().flatten()
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(flat.numel(), generator=g)[:max_points]
    xs = flat[idx].double().numpy()
    fig = go.Figure()
    lo, hi = float(xs.min()), float(xs.max())
    fig.add_scatter(x=[lo, hi], y=[lo, hi], mode="lines", line={"color": "#999", "dash": "dot"}, name="identity")
    df = pd.DataFrame({"original": xs})
    for i, (name, t) in enumerate(xq.items()):
        ys = t.detach().flatten()[idx].double().numpy()
        df[name] = ys
        fig.add_scatter(x=xs, y=ys, mode="markers", marker={"size": 4, "color": PALETTE[i % len(PALETTE)]}, name=name)
    if log:
        fig.update_xaxes(type="log")
        fig.update_yaxes(type="log")
    return _layout(fig, "quantized vs original value (sample)", "original value", "quantized value"), df


# ---------------------------------------------------------------- evaluation history
def accuracy_vs_bits(history: list[dict[str, Any]], metric: str = "q_top1") -> tuple[Figure, pd.DataFrame]:
    """One line per (preset, W bits, data): the metric against activation bits. A line joins
    only runs that share weight bits and data, so no line mixes W4 with W8 or two datasets."""
    df = pd.DataFrame(history)
    if df.empty:
        return _layout(go.Figure(), "no runs yet", "activation bits", metric), df
    if metric not in df or df[metric].isna().all():
        metric = "agreement"
    df["data_key"] = [d.get("key", "not recorded") if isinstance(d, dict) else "not recorded" for d in df.get("data", [None] * len(df))]
    several = df.data_key.nunique() > 1
    # a reconstructed run is another method: never on the same line as the plain preset
    df["variant"] = [f"{p} {options_label(c if isinstance(c, dict) else None)}".strip()
                     for p, c in zip(df.preset, df.get("config", [None] * len(df)))]
    fig = go.Figure()
    for i, ((method, w, key), g) in enumerate(df.groupby(["variant", "wbits", "data_key"])):
        g = g.sort_values("abits")
        name = f"{method} W{w}" + (f" · {key}" if several else "")
        fig.add_scatter(x=g.abits, y=g[metric], mode="lines+markers", name=name, marker_color=PALETTE[i % len(PALETTE)],
                        text=[f"W{w}A{a}" for a in g.abits],
                        hovertemplate="%{text}: %{y:.2f}<extra>" + name + "</extra>")
    if "fp_top1" in df and metric == "q_top1" and df.fp_top1.notna().any():
        fig.add_hline(y=float(df.fp_top1.dropna().iloc[-1]), line_dash="dash", annotation_text="full precision")
    label = {"q_top1": "top-1 accuracy (%)", "agreement": "agreement with FP top-1 (%)", "kl": "KL(FP‖Q) (nats)"}.get(metric, metric)
    fig.update_xaxes(dtick=1)
    return _layout(fig, f"{label} against activation bits (one line per preset and weight bits)",
                   "activation bits (A)", label), df
