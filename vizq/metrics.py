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
    return kl_to(p, torch.log(p.clamp_min(_EPS)), pq)


def kl_to(p: Tensor, logp: Tensor, pq: Tensor) -> float:
    """:func:`kl_rows` against a reference already normalised (``p``) with its log: the lab
    compares many quantizers with one reference and computes its side once."""
    q = pq.float().clamp_min(0)
    q = q / q.sum(-1, keepdim=True).clamp_min(_EPS)
    kl = torch.where(p > 0, p * (logp - torch.log(q.clamp_min(_EPS))), 0.0)
    return float(kl.sum(-1).mean())


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
    Same float32 arithmetic as :func:`mse`, :func:`sqnr_db`, :func:`cosine`, :func:`max_abs_error`."""
    a, b = x.float(), xq.float()
    d2 = (a - b).pow(2)
    noise = float(d2.sum())
    signal = float(a.pow(2).sum()) if signal is None else signal
    norm = float(a.flatten().norm()) if norm is None else norm
    den = norm * float(b.flatten().norm())
    out = {
        "mse": float(d2.mean()),
        "sqnr_db": math.inf if noise == 0 else 10 * math.log10(max(signal, _EPS) / noise),
        "cosine": float(a.flatten() @ b.flatten()) / den if den > 0 else (1.0 if torch.equal(a, b) else 0.0),
        "max_abs_error": float(d2.max().sqrt()) if d2.numel() else 0.0,
    }
    if probabilities:
        out["kl"] = kl_rows(x, xq)
    return out
