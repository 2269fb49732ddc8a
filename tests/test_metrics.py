"""The lab's error metrics against their textbook definitions, on a real softmax and a real
quantizer's output (the fast forms use dot products and a precomputed entropy term)."""
from __future__ import annotations

import math

import pytest
import torch

from vizq import metrics
from vizq.quant import get_quantizer


@pytest.fixture(scope="module")
def probs_and_quantized() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 3, 50, 50) * 4, -1)
    p[0, 0, 0] = 0.0  # a row with exact zeros in the reference, as after masking
    p[0, 0, 0, :5] = 0.2
    q = get_quantizer("log2", 3).calibrate(p)
    return p, q.fake_quant(p)  # 3-bit log2 rounds many probabilities to exactly 0


def textbook_kl(p: torch.Tensor, pq: torch.Tensor) -> float:
    p = p / p.sum(-1, keepdim=True)
    q = pq.clamp_min(0)
    q = q / q.sum(-1, keepdim=True)
    terms = [pi * (math.log(pi) - math.log(max(qi, 1e-12)))
             for pi, qi in zip(p.double().flatten().tolist(), q.double().flatten().tolist()) if pi > 0]
    return sum(terms) / (p.numel() // p.shape[-1])


def test_kl_matches_the_textbook_sum_with_zeros_on_both_sides(probs_and_quantized):
    p, pq = probs_and_quantized
    assert bool((pq == 0).any()) and bool((p == 0).any())
    want = textbook_kl(p, pq)
    assert metrics.kl_rows(p, pq) == pytest.approx(want, rel=1e-5)
    assert metrics.kl_to(p, metrics.neg_entropy(p), pq) == pytest.approx(want, rel=1e-5)
    assert metrics.kl_rows(p, p) == pytest.approx(0.0, abs=1e-6)


def test_tensor_metrics_match_the_single_metric_functions(probs_and_quantized):
    p, pq = probs_and_quantized
    m = metrics.tensor_metrics(p, pq, probabilities=True)
    d = (p.double() - pq.double()).flatten()
    assert m["mse"] == pytest.approx(float((d**2).mean()), rel=1e-5)
    assert m["sqnr_db"] == pytest.approx(10 * math.log10(float((p.double() ** 2).sum()) / float((d**2).sum())), abs=1e-4)
    assert m["cosine"] == pytest.approx(metrics.cosine(p, pq), rel=1e-6)
    assert m["max_abs_error"] == metrics.max_abs_error(p, pq)
    assert m["kl"] == pytest.approx(textbook_kl(p, pq), rel=1e-5)
    exact = metrics.tensor_metrics(p, p)
    assert exact["sqnr_db"] == math.inf and exact["mse"] == 0.0 and exact["max_abs_error"] == 0.0
