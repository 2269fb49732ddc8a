"""The quantizer lab: several quantizers on the very same captured tensor, side by side.

Each row: the plain errors (MSE, SQNR, cosine, max abs, KL for probabilities) and the
task-aware error where the site allows it (attention output for post-Softmax, next-Linear
output for post-LN / post-GELU), plus how long calibrate + fake_quant took.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from . import metrics
from .quant import QuantizerError, get_quantizer
from .quant.step import STEP_FAMILIES, StepFunction

Tensor = torch.Tensor


@dataclass
class LabInput:
    """A site's captured tensor and what its task-aware error needs."""

    site: str
    kind: str
    x: Tensor
    v: Tensor | None = None  # values, for post-Softmax
    weight: Tensor | None = None  # next Linear's weight, for post-LN / post-GELU

    @cached_property
    def reference(self) -> dict[str, Tensor]:
        """What every quantizer's metrics compare against, computed once per input (the lab
        runs six quantizers on the same tensor: the float side need not be redone six times)."""
        ref: dict[str, Tensor] = {"x": self.x.float()}
        ref["signal"] = ref["x"].pow(2).sum()  # Σx² (SQNR) and ‖x‖ (cosine), once per input
        ref["norm"] = ref["x"].flatten().norm()
        if self.kind == "post_softmax":
            p = ref["x"].clamp_min(0)
            p = p / p.sum(-1, keepdim=True).clamp_min(metrics.EPS)
            ref["p"], ref["plogp"] = p, metrics.neg_entropy(p)
        if self.v is not None:
            ref["pv"] = ref["x"] @ self.v.float()
        if self.weight is not None and self.x.shape[-1] == self.weight.shape[1]:
            ref["xw"] = ref["x"].reshape(-1, self.x.shape[-1]) @ self.weight.float().T
        return ref

    @property
    def task_metric(self) -> str | None:
        if self.v is not None:
            return "attn_output_error"
        if self.weight is not None:
            return "linear_output_error"
        return None


def parse_quantizer(text: str) -> tuple[str, dict[str, Any]]:
    """``uniform:granularity=channel:method=mse`` -> ('uniform', {...}); values parsed as
    int/float/bool/None where they look like one."""
    name, *parts = text.strip().split(":")
    opts: dict[str, Any] = {}
    for p in parts:
        if "=" not in p:
            raise QuantizerError(f"quantizer option {p!r} in {text!r} must look like key=value")
        k, v = p.split("=", 1)
        opts[k.strip()] = _parse_value(v.strip())
    return name, opts


def _parse_value(v: str) -> Any:
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def lab_input(capture: Any, site_name: str, model: torch.nn.Module | None = None) -> LabInput:
    """Build the lab input for ``site_name`` from a Capture (and the model, for weights)."""
    st = capture.site(site_name)
    s = st.site
    x = st.sample()
    v = w = None
    if s.kind == "post_softmax":
        vname = s.name.rsplit(".", 1)[0] + ".v"
        if vname in capture.stats:
            v = capture.stats[vname].sample()
            if v.shape[:-1] != x.shape[:-1]:
                v = None
    elif s.kind in ("post_ln", "post_gelu", "attn_proj_in", "linear_in") and model is not None and s.consumers:
        mod = model.get_submodule(s.consumers[0])
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight.detach().float()
    return LabInput(s.name, s.kind, x, v, w)


def run_quantizer(inp: LabInput, name: str, bits: int | None, options: dict[str, Any]) -> tuple[dict[str, Any], Any, Tensor]:
    """Calibrate + fake-quant one quantizer; returns (metrics row, quantizer, x̂)."""
    q = get_quantizer(name, bits, **options)
    t0 = time.perf_counter()
    q.calibrate(inp.x)
    # the engine's bit-exact step function (one table lookup per value) where the formula is slower
    step = StepFunction.build(q) if q.family in STEP_FAMILIES else None
    xq = step(inp.x) if step is not None else q.fake_quant(inp.x)
    ms = 1000 * (time.perf_counter() - t0)
    row: dict[str, Any] = {"quantizer": name, "bits": q.bits,
                           "options": ",".join(f"{k}={v}" for k, v in options.items()) or "-"}
    ref = inp.reference
    row.update(metrics.tensor_metrics(ref["x"], xq, signal=float(ref["signal"]), norm=float(ref["norm"])))
    if "p" in ref:
        row["kl"] = metrics.kl_to(ref["p"], ref["plogp"], xq)
    if "pv" in ref:
        row["attn_output_error"] = metrics.relative_error(ref["pv"], xq.float() @ inp.v.float())
    if "xw" in ref:
        row["linear_output_error"] = metrics.relative_error(
            ref["xw"], xq.float().reshape(-1, inp.x.shape[-1]) @ inp.weight.float().T)
    row["ms"] = ms
    return row, q, xq


def compare(inp: LabInput, choices: list[tuple[str, int | None, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One metrics row per (name, bits, options)."""
    return [run_quantizer(inp, n, b, o)[0] for n, b, o in choices]
