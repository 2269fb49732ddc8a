"""PTQ cost on CPU for a DeiT-S-sized model (random init, 224 px, 32 calibration images).

Prints calibration seconds per method and quantized-vs-FP evaluation throughput, measured
side by side in one run. Targets: calibration < 2 min; quantized eval >= 0.7x FP throughput.
Run: .venv/bin/python bench/bench_ptq.py [--methods repq,minmax] [--batch 16] [--iters 3]
"""
from __future__ import annotations

import argparse
import time

import torch

from vizq.models import load_model
from vizq.ptq.config import QuantConfig
from vizq.ptq.engine import QuantizedModel


def throughput(model: torch.nn.Module, x: torch.Tensor, iters: int) -> float:
    with torch.no_grad():
        model(x)  # warm-up
        t0 = time.perf_counter()
        for _ in range(iters):
            model(x)
    return iters * x.shape[0] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:deit_small_patch16_224")
    ap.add_argument("--methods", default="minmax,repq,adalog,fp8,mxfp4")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model(a.model)
    g = torch.Generator().manual_seed(0)
    calib = torch.randn(32, *lm.info.input_size, generator=g)
    x = torch.randn(a.batch, *lm.info.input_size, generator=g)
    print(f"{a.model}: {lm.info.num_params / 1e6:.1f} M parameters, {torch.get_num_threads()} threads")
    fp = throughput(lm.model, x, a.iters)
    print(f"FP eval: {fp:.1f} img/s")
    print(f"{'method':<8} {'calibrate s':>12} {'q img/s':>9} {'q/FP':>6}")
    for m in a.methods.split(","):
        t0 = time.perf_counter()
        qm = QuantizedModel(lm, QuantConfig(method=m, wbits=4, abits=4)).calibrate(calib)
        cal = time.perf_counter() - t0
        fp = throughput(lm.model, x, a.iters)  # re-measured beside each method
        q = throughput(qm, x, a.iters)
        print(f"{m:<8} {cal:12.1f} {q:9.1f} {q / fp:6.2f}")
        qm.remove_hooks()


if __name__ == "__main__":
    main()
