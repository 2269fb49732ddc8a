"""PTQ cost on CPU for a DeiT-S-sized model (random init, 224 px, 32 calibration images).

Prints calibration seconds per method and quantized-vs-FP evaluation throughput, measured
side by side in one run (batches timed in alternation, medians). Targets: calibration < 2 min;
quantized eval >= 0.7x FP throughput. ``VIZQ_NATIVE=0`` measures the torch-only path.
Run: .venv/bin/python bench/bench_ptq.py [--methods repq,minmax] [--batch 16] [--iters 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` finds vizq

from vizq.models import load_model
from vizq.ptq.config import QuantConfig
from vizq.ptq.engine import QuantizedModel
from vizq.quant import native


def side_by_side(fp: torch.nn.Module, q: torch.nn.Module, x: torch.Tensor, iters: int) -> tuple[float, float]:
    """Median images/s of the float and the quantized model, timed in alternation so that a
    busy or throttled machine slows both alike."""
    t_fp, t_q = [], []
    with torch.no_grad():
        fp(x), q(x)  # warm-up
        for _ in range(iters):
            for model, times in ((fp, t_fp), (q, t_q)):
                t0 = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - t0)
    return x.shape[0] / statistics.median(t_fp), x.shape[0] / statistics.median(t_q)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:deit_small_patch16_224")
    ap.add_argument("--methods", default="minmax,repq,adalog,fp8,mxfp4")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model(a.model)
    g = torch.Generator().manual_seed(0)
    calib = torch.randn(32, *lm.info.input_size, generator=g)
    x = torch.randn(a.batch, *lm.info.input_size, generator=g)
    kernel = "compiled kernel" if native.available() else "torch ops only"
    print(f"{a.model}: {lm.info.num_params / 1e6:.1f} M parameters, {torch.get_num_threads()} threads, {kernel}")
    print(f"{'method':<8} {'calibrate s':>12} {'FP img/s':>9} {'q img/s':>9} {'q/FP':>6}")
    for m in a.methods.split(","):
        t0 = time.perf_counter()
        qm = QuantizedModel(lm, QuantConfig(preset=m, wbits=4, abits=4)).calibrate(calib)
        cal = time.perf_counter() - t0
        fp, q = side_by_side(lm.model, qm, x, a.iters)
        print(f"{m:<8} {cal:12.1f} {fp:9.1f} {q:9.1f} {q / fp:6.2f}")
        qm.remove_hooks()


if __name__ == "__main__":
    main()
