"""Error metrics between a tensor and its quantized version, plain and task-aware.

Task-aware errors measure what the next operation sees: for attention probabilities the
attention output P·V, for post-LayerNorm / post-GELU activations the next Linear's output.
"""
from __future__ import annotations

import math

import torch

Tensor = torch.Tensor
EPS = _EPS = 1e-12


def mse(x: Tensor, xq: Tensor) -> float:
    return float((x.float() - xq.float()).pow(2).mean())


def sqnr_db(x: Tensor, xq: Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when exact)."""
    noise = float((x.float() - xq.float()).pow(2).sum())
    signal = float(x.float().pow(2).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(max(signal, _EPS) / noise)


def cosine(x: Tensor, xq: Tensor) -> float:
    a, b = x.float().flatten(), xq.float().flatten()
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else (1.0 if torch.equal(a, b) else 0.0)


def max_abs_error(x: Tensor, xq: Tensor) -> float:
    return float((x.float() - xq.float()).abs().max())


def kl_rows(p: Tensor, pq: Tensor) -> float:
    """Mean KL(p ‖ p̂) over the last-dim rows of probability tensors.

    Quantized rows no longer sum to 1 and may hold zeros, so both are renormalised and the
    quantized one is floored at 1e-12 (a zeroed probability costs a large but finite penalty).
    """
    p = p.float().clamp_min(0)
    p = p / p.sum(-1, keepdim=True).clamp_min(_EPS)
    return kl_to(p, neg_entropy(p), pq)


def neg_entropy(p: Tensor) -> Tensor:
    """Σ p·log p per row (zeros contribute 0): the reference's half of KL, computed once when
    many quantized versions meet one reference (the lab)."""
    return torch.where(p > 0, p * torch.log(p.clamp_min(_EPS)), 0.0).sum(-1)


def kl_to(p: Tensor, plogp: Tensor, pq: Tensor) -> float:
    """:func:`kl_rows` against a reference already normalised (``p``), given its
    :func:`neg_entropy`: KL = Σ p·log p − Σ p·log p̂, the second sum one dot product per row.
    Where p = 0 the term is 0 as in the textbook form (log p̂ is floored, hence finite); two
    passes over the quantized side instead of six made the lab's KL 3× cheaper."""
    q = pq.float().clamp_min(0)
    logq = q.div_(q.sum(-1, keepdim=True).clamp_min_(_EPS)).clamp_min_(_EPS).log_()
    cross = torch.linalg.vecdot(p, logq)
    return float((plogp - cross).mean())


def relative_error(ref: Tensor, approx: Tensor) -> float:
    """‖ref - approx‖ / ‖ref‖."""
    den = float(ref.float().norm())
    return float((ref.float() - approx.float()).norm()) / max(den, _EPS)


def attention_output_error(p: Tensor, pq: Tensor, v: Tensor) -> float:
    """‖P·V − P̂·V‖ / ‖P·V‖ for attention probabilities [..., N, N] and values [..., N, D]."""
    return relative_error(p.float() @ v.float(), pq.float() @ v.float())


def linear_output_error(x: Tensor, xq: Tensor, weight: Tensor) -> float:
    """‖X·Wᵀ − X̂·Wᵀ‖ / ‖X·Wᵀ‖ for the Linear that consumes X (bias cancels out)."""
    w = weight.float()
    return relative_error(x.float() @ w.T, xq.float() @ w.T)


def token_relative_output_error(dx: Tensor, x: Tensor, weight: Tensor, eps: float = 1e-12) -> Tensor:
    """Mean over tokens of ||dx_t·Wᵀ||² / ||x_t·Wᵀ||²: the next Linear's output error, each token
    relative to its own output. ``dx`` is [K, ..., C] (K candidates), ``x`` [..., C]; returns [K, 1].

    The plain output MSE is ruled by the few tokens that carry massive activations (their
    errors are thousands of times larger), so it keeps a range that rounds every ordinary token
    to zero; per token, each position counts once, and erasing a block's MLP for 190 of 197
    tokens costs what it should."""
    c = weight.shape[1]
    k = dx.shape[0]
    err = (dx.reshape(k, -1, c) @ weight.T).pow(2).sum(-1)  # [K, T]
    ref = (x.reshape(-1, c) @ weight.T).pow(2).sum(-1)  # [T]
    return (err / (ref + eps)[None]).mean(1, keepdim=True)


def tensor_metrics(x: Tensor, xq: Tensor, probabilities: bool = False, signal: float | None = None,
                   norm: float | None = None) -> dict[str, float]:
    """All plain metrics (KL only where rows are probabilities), from one difference tensor;
    ``signal`` (Σx²) and ``norm`` (‖x‖) may come precomputed when one x meets many x̂ (the lab).
    Sums are float32 dot products, so values agree with :func:`mse`, :func:`sqnr_db` and
    :func:`cosine` to float32 rounding (summation order differs), not bit for bit."""
    a, b = x.float().reshape(-1), xq.float().reshape(-1)
    d = a - b
    noise = float(d @ d)  # dot products: one fused pass each, no squared copy
    signal = float(a @ a) if signal is None else signal
    norm = math.sqrt(signal) if norm is None else norm
    den = norm * math.sqrt(float(b @ b))
    out = {
        "mse": noise / d.numel() if d.numel() else 0.0,
        "sqnr_db": math.inf if noise == 0 else 10 * math.log10(max(signal, _EPS) / noise),
        "cosine": float(a @ b) / den if den > 0 else (1.0 if torch.equal(a, b) else 0.0),
        "max_abs_error": float(d.abs_().max()) if d.numel() else 0.0,
    }
    if probabilities:
        out["kl"] = kl_rows(x, xq)
    return out
