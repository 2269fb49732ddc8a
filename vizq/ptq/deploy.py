"""Deployable export: from a research configuration to an ONNX QDQ graph a runtime executes,
and how much accuracy survives the trip.

A preset may use quantizers no runtime has (log√2, AdaLog, twin-uniform, MX blocks …). For
those sites the user chooses (:class:`NonUniform`): keep them in float (the "deployable
subset") or replace them by a uniform grid at the same bits, calibrated on the same data.
Either way the result is a vizq configuration of its own, calibrated like any other, so the
graph can be checked against vizq's fake-quant model of exactly that configuration (parity:
does the runtime compute what vizq computes?) and against the research configuration (the gap:
what deploying costs). The CLI and the Export page both call :func:`prepare` then :func:`write`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..capture import site_hooks
from ..dataspec import DataSpec
from ..errors import Cancelled, InputError
from ..family import LoadedModel
from ..quant import Granularity
from .config import ConfigError, QuantConfig
from .engine import QuantizedModel
from .evaluate import Calibration, calibrate, eval_split
from .qdq import OPSET, Entry, Graph, Qdq, build, qdq_for

Progress = Callable[[int, int, str], None]


class NonUniform(str, Enum):
    """What to do with a site whose quantizer has no QDQ form."""

    FLOAT = "float"  # leave the site unquantized in the graph
    UNIFORM = "uniform"  # uniform at the same bits, calibrated on the same data


def site_forms(qm: QuantizedModel) -> list[dict[str, Any]]:
    """Every quantized site: its quantizer and how (or whether) it is written as QDQ."""
    rows = []
    for s in qm.sites:
        q = qm.acts[s.name].q if s.name in qm.acts else qm.weights.get(s.module) if s.kind == "weight" else None
        if q is None:
            continue
        form = qdq_for(q)
        rows.append({"site": s.name, "kind": s.kind, "quantizer": q.name, "bits": q.bits,
                     "qdq": form.describe() if form else "no QDQ equivalent",
                     "notes": "; ".join(form.notes) if form else ""})
    return rows


def _uniform_rule(q: Any, weight: bool) -> dict[str, Any]:
    g = q.granularity
    if weight:  # a weight keeps per-tensor or per-axis sharing; blocks become per output channel
        g = g if g in (Granularity.TENSOR, Granularity.OUT_CHANNEL, Granularity.CHANNEL) else Granularity.OUT_CHANNEL
    elif g.scope != "per-axis" or g is Granularity.OUT_CHANNEL:
        g = Granularity.TENSOR
    return {"quantizer": "uniform", "bits": q.bits, "options": {"granularity": g.value, "method": "percentile"}}


def deployable_config(qm: QuantizedModel, choice: NonUniform) -> tuple[QuantConfig, list[dict[str, Any]]]:
    """``qm``'s configuration with every non-QDQ site resolved by ``choice`` (exact-name
    overrides, applied after the user's own), and the list of what changed."""
    overrides = dict(qm.config.overrides)
    changed = []
    quantized = [(n, a.q, False) for n, a in qm.acts.items()] + [(f"{p}.weight", q, True) for p, q in qm.weights.items()]
    for name, q, weight in quantized:
        if qdq_for(q) is not None:
            continue
        rule = {"enabled": False} if choice is NonUniform.FLOAT else _uniform_rule(q, weight)
        overrides[name] = rule
        now = "float" if choice is NonUniform.FLOAT else f"uniform {q.bits}-bit ({rule['options']['granularity']})"
        changed.append({"site": name, "was": f"{q.name} {q.bits}-bit", "now": now})
    cfg = QuantConfig.from_dict({**qm.config.to_dict(), "overrides": overrides})
    return cfg, changed


@dataclass
class Deployment:
    """A research calibration, the deployable one derived from it, its graph, and the check."""

    research: Calibration
    deployed: Calibration
    choice: NonUniform
    graph: Graph
    changed: list[dict[str, Any]]
    forms: list[dict[str, Any]]
    parity: dict[str, Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)  # DataSpec.record() of the calibration/check data

    def report(self) -> dict[str, Any]:
        """What ``deploy.json`` holds (and the Export page shows)."""
        return {"format": "onnx-qdq", "opset": OPSET, "non_uniform": self.choice.value,
                "changed_sites": self.changed, "sites": self.forms, "parity": self.parity,
                "seconds": self.seconds, "data": self.data, "research_config": self.research.qmodel.config.to_dict(),
                "entries": [{"site": e.site, "weight": e.weight, "bits": e.qdq.bits, "signed": e.qdq.signed,
                             "axis": e.qdq.axis, "scale": np.asarray(e.qdq.scale).tolist(),
                             "zero_point": np.asarray(e.qdq.zero_point).tolist()} for e in self.graph.entries]}


def prepare(loaded: LoadedModel, config: QuantConfig, data: DataSpec | str | None = None, choice: NonUniform = NonUniform.FLOAT,
            check_images: int = 200, device: str | torch.device = "cpu", batch_size: int = 32,
            progress: Progress | None = None, cancel: Callable[[], bool] | None = None,
            calib_progress: Progress | None = None) -> Deployment:
    """Calibrate ``config``, derive and calibrate its deployable form, build the QDQ graph and
    (``check_images`` > 0) run it in ONNX Runtime next to vizq on held-out images.
    ``calib_progress`` reports the calibrations, ``progress`` the check (images)."""
    if loaded.info.modality != "image":
        raise InputError("ONNX export covers image models; text encoders export as vizq folders only (--format vizq)")
    t0 = time.time()
    research = calibrate(loaded, config, data, device, progress=calib_progress, cancel=cancel)
    dep_cfg, changed = deployable_config(research.qmodel, choice)
    deployed = research
    if changed:  # the deployable form: uniform at the changed sites, recalibrated on the same data
        deployed = calibrate(loaded, dep_cfg, data, device, progress=calib_progress, cancel=cancel)
    t1 = time.time()
    example = torch.zeros(1, *loaded.info.input_size)
    graph = build(deployed.qmodel, example)
    dep = Deployment(research, deployed, choice, graph, changed, site_forms(deployed.qmodel),
                     seconds={"calibrate": t1 - t0, "onnx": time.time() - t1}, data=DataSpec.of(data).record())
    if check_images:
        t2 = time.time()
        images, idx = eval_split(loaded, config, data, check_images)
        dep.parity = check(loaded, dep, images, idx, batch_size, progress, cancel)
        dep.seconds["check"] = time.time() - t2
    return dep


def session(model: bytes, threads: int | None = None) -> Any:
    """An ONNX Runtime CPU session on the graph (all graph optimizations on, as deployed)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


@torch.no_grad()
def check(loaded: LoadedModel, dep: Deployment, images: Any, idx: list[int], batch_size: int = 32,
          progress: Progress | None = None, cancel: Callable[[], bool] | None = None,
          site_images: int = 4) -> dict[str, Any]:
    """Full precision, the research model, vizq's deployable model and ORT on the same images:
    top-1 (where labels exist), ORT-vs-vizq agreement and max |logit difference|, and per site
    where the two first diverge (on the first ``site_images`` images).

    Also the *noise floor*: vizq's deployable model once more with float64 arithmetic between
    its quantizers. A quantized ViT's top-1 can hinge on float rounding (a value one ulp from a
    rounding boundary flips a level; deeper sites amplify it), so two exact implementations of
    the same graph need not agree on every image. ``agreement_stable`` is ORT-vs-vizq agreement
    on the images whose prediction survives that change, i.e. where vizq's answer is defined."""
    sess = session(dep.graph.model)
    fp_model, research, deployed = loaded.model.cpu().eval(), dep.research.qmodel.cpu(), dep.deployed.qmodel.cpu()
    n = labeled = 0
    counts = {"agree": 0, "agree_research": 0, "stable": 0, "agree_stable": 0}
    hits = {"fp": 0, "research": 0, "vizq": 0, "ort": 0, "vizq_f64": 0}
    max_diff, first = 0.0, None
    if progress:
        progress(0, len(idx), "")
    for xb, yb, _ in loaded.iterate(images, idx, batch_size):
        if cancel and cancel():
            raise Cancelled("check cancelled; nothing was written")
        if first is None:
            first = xb[:site_images]
        logits = {"fp": fp_model(xb), "research": research(xb), "vizq": deployed(xb),
                  "ort": torch.from_numpy(sess.run(["logits"], {"input": xb.numpy()})[0]),
                  "vizq_f64": _in_float64(deployed, xb)}
        top = {k: v.argmax(-1) for k, v in logits.items()}
        n += xb.shape[0]
        stable = top["vizq"] == top["vizq_f64"]
        same = top["ort"] == top["vizq"]
        counts["agree"] += int(same.sum())
        counts["agree_research"] += int((top["ort"] == top["research"]).sum())
        counts["stable"] += int(stable.sum())
        counts["agree_stable"] += int((same & stable).sum())
        max_diff = max(max_diff, float((logits["ort"] - logits["vizq"]).abs().max()))
        if yb is not None:
            labeled += yb.shape[0]
            for k in hits:
                hits[k] += int((top[k] == yb).sum())
        if progress:
            progress(n, len(idx), "")
    if n == 0:
        raise InputError("none of the check images could be read")
    pct = (lambda k: 100.0 * hits[k] / labeled) if labeled else (lambda k: None)
    return {"images": n, "labels": bool(labeled), "fp_top1": pct("fp"), "research_top1": pct("research"),
            "vizq_top1": pct("vizq"), "ort_top1": pct("ort"), "vizq_f64_top1": pct("vizq_f64"),
            "agreement": 100.0 * counts["agree"] / n, "agreement_research": 100.0 * counts["agree_research"] / n,
            "noise_floor_agreement": 100.0 * counts["stable"] / n,
            "agreement_stable": 100.0 * counts["agree_stable"] / max(counts["stable"], 1),
            "stable_images": counts["stable"], "max_abs_logit_diff": max_diff,
            "sites": site_divergence(dep, first)}


def _in_float64(qm: QuantizedModel, x: torch.Tensor) -> torch.Tensor:
    """``qm`` with float64 arithmetic between its quantizers (they still quantize in float32);
    float32 -> float64 -> float32 is exact, so the model is unchanged afterwards."""
    try:
        return qm.model.double()(x.double()).float()
    finally:
        qm.model.float()


def site_divergence(dep: Deployment, x: torch.Tensor) -> list[dict[str, Any]]:
    """Per activation site, in network order: how far ORT's dequantized tensor is from vizq's,
    in quantization steps, and the share of values on a different level."""
    import onnx
    from onnx import TensorProto, helper

    outputs = dep.graph.site_outputs()
    m = onnx.load_from_string(dep.graph.model)
    m.graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs.values())
    got = session(m.SerializeToString()).run(list(outputs.values()), {"input": x.numpy()})
    qm = dep.deployed.qmodel
    seen: dict[str, torch.Tensor] = {}

    def keep(site: Any, t: torch.Tensor) -> None:
        seen.setdefault(site.name, t.detach().clone())

    with site_hooks(qm.model, qm._hook_sites(), keep):
        qm(x)
    step = {e.site: e.qdq for e in dep.graph.entries if not e.weight}
    rows = []
    for (site, _), ort_t in zip(outputs.items(), got):
        ref = seen.get(site)
        if ref is None or tuple(ref.shape) != ort_t.shape:
            continue
        q = step[site]
        s = torch.from_numpy(np.asarray(q.scale, dtype=np.float32))
        if q.axis is not None:
            shape = [1] * ref.dim()
            shape[q.axis] = -1
            s = s.reshape(shape)
        d = (torch.from_numpy(ort_t) - ref).abs() / s
        rows.append({"site": site, "max_steps": float(d.max()), "changed_pct": 100.0 * float((d > 0.5).double().mean()),
                     "notes": "; ".join(q.notes)})
    return rows


def first_difference(rows: list[dict[str, Any]]) -> str | None:
    """One sentence on where ORT and vizq start to differ and why (for the CLI and the page)."""
    row = next((r for r in rows if r["max_steps"] > 0.01), None)  # float noise alone stays ~1e-6 steps
    if row is None:
        return None
    if row["notes"]:
        return (f"ORT and vizq first differ at {row['site']} (up to {row['max_steps']:.2f} steps): {row['notes']}. "
                "The difference then grows through later sites")
    return (f"ORT and vizq first differ at {row['site']} ({row['changed_pct']:.4f}% of values one level apart): "
            "float rounding differences between the two runtimes, amplified by later sites")


def load(path: str | Path, loaded: LoadedModel) -> Deployment:
    """An ONNX export folder back as a :class:`Deployment` (its vizq model reloaded bit-exactly,
    its graph read and checked), so it can be checked again; a damaged folder is one clear error."""
    import onnx

    from .export import load_export, read_json

    path = Path(path)
    qm = load_export(path, loaded)
    graph_file, report_file = path / "model.onnx", path / "deploy.json"
    if not graph_file.is_file() or not report_file.is_file():
        raise ConfigError(f"{path} has no model.onnx/deploy.json: it was not exported with --format onnx; export again")
    data = graph_file.read_bytes()
    try:
        onnx.checker.check_model(onnx.load_from_string(data), full_check=True)
    except Exception as e:  # noqa: BLE001 - any parser/checker failure means a damaged file
        raise ConfigError(f"{path.name}/model.onnx is damaged ({type(e).__name__}: {str(e)[:120]}); export again") from None
    report = read_json(report_file)
    if not isinstance(report, dict) or report.get("format") != "onnx-qdq":
        raise ConfigError(f"{path.name}/deploy.json is not a vizq ONNX report; export again")
    entries = [Entry(e["site"], _qdq_from(e), e["weight"]) for e in report.get("entries", [])]
    cal = Calibration(qm, list(qm.calib_ids), [], 0.0)
    return Deployment(cal, cal, NonUniform(report.get("non_uniform", "uniform")), Graph(data, entries),
                      report.get("changed_sites", []), report.get("sites", []), report.get("parity"))


def _qdq_from(e: dict[str, Any]) -> Qdq:
    return Qdq(np.asarray(e["scale"], dtype=np.float32), np.asarray(e["zero_point"], dtype=np.int64), e["axis"],
               e["bits"], e["signed"])


def write(dep: Deployment, out: str | Path, force: bool = False) -> Path:
    """The export folder: vizq's own files for the deployable configuration (reloadable
    bit-exactly), ``model.onnx`` and ``deploy.json``, committed in one atomic step."""
    from .export import export

    report = dep.report()
    return export(dep.deployed.qmodel, out, dep.deployed.image_ids, force=force, skipped=dep.deployed.skipped,
                  extra={"model.onnx": dep.graph.model, "deploy.json": (json.dumps(report, indent=2) + "\n").encode()},
                  manifest_extra={"data": dep.data, "onnx": {"file": "model.onnx", "opset": OPSET, "non_uniform": dep.choice.value,
                                           "changed_sites": len(dep.changed)}})


def archive(dep: Deployment) -> bytes:
    """The export folder as a zip (for a browser download): written by :func:`write` to a
    temporary folder first, so the zip holds exactly what the CLI would have written."""
    import tempfile

    from .export import zip_folder

    with tempfile.TemporaryDirectory() as tmp:
        return zip_folder(write(dep, Path(tmp) / "vizq-onnx-export"), "vizq-onnx-export")
