"""Quantizer speed: calibrate + fake_quant on 1M values, and the lab's default comparison.

Prints milliseconds and the ratio to a plain uniform min/max pass measured in the same run.
Run: .venv/bin/python bench/bench_quantizers.py
"""
from __future__ import annotations

import statistics
import time

import torch

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` finds vizq

from vizq.quant import get_quantizer, list_quantizers


def timings(fn, repeat: int = 5) -> list[float]:
    fn()  # warm-up
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(1000 * (time.perf_counter() - t0))
    return ts


def timed(fn, repeat: int = 5) -> float:
    return statistics.median(timings(fn, repeat))


def run(name: str, x: torch.Tensor, bits: int | None = None) -> float:
    def go() -> None:
        q = get_quantizer(name, bits)
        q.calibrate(x)
        q.fake_quant(x)

    return timed(go)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    acts = torch.randn(1024, 1024) * torch.linspace(0.2, 4, 1024)  # 1M values, per-channel spread
    probs = torch.softmax(torch.randn(16, 4, 128, 128) * 3, -1)  # 1M attention probabilities
    rows = []
    for name in ["uniform"] + list_quantizers():  # the first, discarded, run warms every code path up
        data = ("probs", probs) if name in ("log2", "logsqrt2", "adalog", "sulq", "tanq", "twin") else ("acts", acts)
        rows.append((name, data[0], run(name, data[1])))
    rows = rows[1:]
    base = next(ms for n, _, ms in rows if n == "uniform")
    print(f"{'quantizer':<12} {'data':<6} {'ms':>8} {'x uniform-minmax':>17}")
    for name, data, ms in rows:
        print(f"{name:<12} {data:<6} {ms:8.1f} {ms / base:17.1f}")

    from vizq.capture import capture_activations
    from vizq.data import resolve_images
    from vizq.lab import compare, lab_input
    from vizq.models import REAL_DEFAULT, load_model

    # the dashboard's default: the real ViT-Ti on the bundled photographs, 8 images kept per site
    lm = load_model(REAL_DEFAULT)
    cap = capture_activations(lm, resolve_images(lm), list(range(8)), batch_size=8, reservoir_images=8)
    six = [(n, 4, {}) for n in ("uniform", "log2", "logsqrt2", "adalog", "tanq", "sulq")]
    # a fresh LabInput each time: the float reference is part of what the page pays on a new site
    runs = timings(lambda: compare(lab_input(cap, "blocks.2.attn.softmax", lm.model), six), repeat=9)
    ms = statistics.median(runs)
    one = timed(lambda: compare(lab_input(cap, "blocks.2.attn.softmax", lm.model), [("uniform", 4, {})]))
    inp = lab_input(cap, "blocks.2.attn.softmax", lm.model)
    print(f"\ndefault comparison: 6 quantizers at 4 bits on blocks.2.attn.softmax {tuple(inp.x.shape)} "
          f"({inp.x.numel()} values, metrics included): median {ms:.0f} ms (range {min(runs):.0f}-{max(runs):.0f} "
          f"over {len(runs)} runs); one uniform min/max: {one:.1f} ms "
          f"(ratio {ms / one:.1f}x); target < 300 ms")


if __name__ == "__main__":
    main()
