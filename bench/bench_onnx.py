"""Latency of the deployable graph: ORT QDQ (W8A8, W4A4) vs ORT fp32 vs PyTorch fp32, on this CPU.

ViT-Ti/16 at 224 px, batch 1 and 16, every variant timed in alternation in one run (medians),
printed as milliseconds and as ratios to PyTorch fp32. Also prints what ONNX Runtime made of
the QDQ pairs after its graph optimizations (which integer kernels it fused them into, how
many DequantizeLinear stayed), because a QDQ graph is only faster where the runtime fuses.
Uses the real weights in ../shared/data when present, else a random-init ViT-Ti (latency does
not depend on the weights' values; the QDQ scales are then calibrated on random images).
Run: .venv/bin/python bench/bench_onnx.py [--iters 20] [--threads 2]
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` finds vizq

from vizq.models import load_model
from vizq.ptq.config import QuantConfig
from vizq.ptq.deploy import prepare

REAL = Path(__file__).resolve().parents[1].parent / "shared/data"
SPEC = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
FUSED = ("QLinearMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QGemm", "MatMulNBits", "QLinearConv",
         "ConvInteger", "MatMulInteger", "QAttention", "QLinearAdd", "QLinearSoftmax")


def fp32_graph(model: torch.nn.Module, size: int) -> bytes:
    buf = io.BytesIO()
    torch.onnx.export(model, (torch.zeros(1, 3, size, size),), buf, dynamo=False, opset_version=20,
                      input_names=["input"], output_names=["logits"], dynamic_axes={"input": {0: "b"}, "logits": {0: "b"}})
    return buf.getvalue()


def ort_session(graph: bytes, threads: int, dump: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3  # the note that an optimized model is machine-specific is expected here
    if dump:
        so.optimized_model_filepath = dump
    return ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])


def fused_ops(graph: bytes, threads: int) -> dict[str, int]:
    """Op counts of the graph as ORT runs it (after its QDQ fusions)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "opt.onnx")
        ort_session(graph, threads, path)
        ops: dict[str, int] = {}
        for n in onnx.load(path, load_external_data=False).graph.node:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    weights = REAL / f"{SPEC}.safetensors"
    spec, data = (f"{SPEC}@{weights}", str(REAL / "imagenet-sample-500")) if weights.is_file() else \
        ("random:vit_tiny_patch16_224", None)
    lm = load_model(spec)
    print(f"model: {spec}   threads: {a.threads}   onnxruntime {ort.__version__}   torch {torch.__version__}")
    size = lm.info.input_size[-1]
    graphs = {"ORT fp32": fp32_graph(lm.model.eval(), size)}
    for w, b in ((8, 8), (4, 4)):
        dep = prepare(lm, QuantConfig(preset="minmax", wbits=w, abits=b, calibration={"images": 8}), data, check_images=0)
        graphs[f"ORT QDQ W{w}A{b}"] = dep.graph.model
    for name, g in graphs.items():
        ops = fused_ops(g, a.threads)
        fused = {k: v for k, v in ops.items() if k in FUSED}
        print(f"{name:>14}: after ORT's optimizations: {fused or 'no integer kernels'}; "
              f"DequantizeLinear left {ops.get('DequantizeLinear', 0)}, QuantizeLinear {ops.get('QuantizeLinear', 0)}, "
              f"float MatMul {ops.get('MatMul', 0) + ops.get('FusedMatMul', 0) + ops.get('Gemm', 0)}")
    sessions = {k: ort_session(g, a.threads) for k, g in graphs.items()}
    for batch in (1, 16):
        x = torch.randn(batch, 3, size, size)
        runners = {"PyTorch fp32": lambda: lm.model(x)}
        runners.update({k: (lambda s=s: s.run(["logits"], {"input": x.numpy()})) for k, s in sessions.items()})
        times: dict[str, list[float]] = {k: [] for k in runners}
        with torch.no_grad():
            for fn in runners.values():
                fn()
                fn()  # warm-up
            for _ in range(a.iters):
                for k, fn in runners.items():
                    t0 = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t0)
        base = statistics.median(times["PyTorch fp32"])
        print(f"\nbatch {batch} ({a.iters} alternating runs, medians)")
        print(f"{'':>16} {'ms':>9} {'vs PyTorch fp32':>16} {'vs ORT fp32':>12}")
        ort_fp = statistics.median(times["ORT fp32"])
        for k, t in times.items():
            m = statistics.median(t)
            print(f"{k:>16} {1000 * m:9.1f} {base / m:15.2f}x {ort_fp / m:11.2f}x")


if __name__ == "__main__":
    main()
