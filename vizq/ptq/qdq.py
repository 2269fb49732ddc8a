"""A calibrated model as a standard ONNX QDQ graph (QuantizeLinear / DequantizeLinear pairs).

How: the calibrated copy is exported with torch's TorchScript ONNX exporter, with an opaque
marker op (``vizq::Mark``) wherever vizq quantizes a tensor (the same site hooks the PTQ engine
uses, and the weights of quantized Linear/Conv layers). The exporter folds everything else
(LayerNorm/Linear reparameterization is already in the copy's parameters, so a post-LN
per-channel quantizer has become per-tensor, as RepQ-ViT intends). Each marker is then
replaced, with the ``onnx`` package, by a QDQ pair whose scale and zero point are vizq's own,
at the bit width's container type: uint4/int4 and uint8/int8 (opset 21 makes 4-bit types and
per-axis scales legal), 16-bit likewise. Bit widths without an ONNX type (3, 5, 6, 7 …) use the
next container and clip to the b-bit range first (Max/Min), which is exact; a runtime then
runs them as 8-bit. Weights are stored as integers with a DequantizeLinear (per output
channel), pre-transposed for MatMul so no Transpose sits between DQ and MatMul.

Only uniform grids have a QDQ form (``QDQ_FORMS``); every other quantizer is reported by
:func:`qdq_for` returning None, and :mod:`vizq.ptq.deploy` decides what to do about it.
"""
from __future__ import annotations

import copy
import io
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..capture import site_hooks
from ..errors import VizqError
from ..quant import Quantizer
from .engine import QuantizedModel

OPSET = 21
_EXPORT_OPSET = 20  # the TorchScript exporter's newest; the QDQ ops are then written at OPSET


@dataclass(frozen=True)
class Qdq:
    """What one QuantizeLinear/DequantizeLinear pair needs: scale and integer zero point
    (scalars, or 1-D along ``axis``), the bit width and signedness of the integer grid."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None
    bits: int
    signed: bool
    notes: tuple[str, ...] = ()

    @property
    def container(self) -> int:
        """The ONNX integer width that holds ``bits`` (4, 8 or 16)."""
        return next(c for c in (4, 8, 16) if self.bits <= c)

    @property
    def qrange(self) -> tuple[int, int]:
        return (-(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1) if self.signed else (0, 2**self.bits - 1)

    @property
    def clipped(self) -> bool:
        """True when the grid is narrower than its container (a Max/Min precedes the Q)."""
        return self.bits != self.container

    def describe(self) -> str:
        t = f"{'int' if self.signed else 'uint'}{self.container}"
        how = f"QDQ {t}" + (f", clipped to {self.bits} bits" if self.clipped else "")
        return how + ("" if self.axis is None else f", per-axis ({self.axis})")


def _group_params(q: Quantizer, scale: torch.Tensor, zp: torch.Tensor, signed: bool) -> Qdq:
    s = scale.detach().double().reshape(-1)
    z = zp.detach().double().reshape(-1)
    notes = []
    zr = torch.round(z)
    if bool((zr != z).any()):  # RepQ-ViT's mean fold leaves a fractional zero point
        worst = float((zr - z).abs().max())
        notes.append(f"zero point rounded to an integer (moved by up to {worst:.3f} steps): RepQ-ViT's mean fold "
                     "leaves it fractional, so fake quantization clamps at off-grid values that no integer grid holds")
    scalar = s.numel() == 1
    return Qdq(scale=s.float().numpy().reshape(()) if scalar else s.float().numpy(),
               zero_point=zr.long().numpy().reshape(()) if scalar else zr.long().numpy(),
               axis=None if scalar else q.axis, bits=q.bits, signed=signed, notes=tuple(notes))


def _uniform(q: Quantizer) -> Qdq:
    return _group_params(q, q.state["scale"], q.state["zero_point"], signed=False)


def _uniform_sym(q: Quantizer) -> Qdq:
    return _group_params(q, q.state["scale"], torch.zeros_like(q.state["scale"]), signed=True)


#: Quantizer name -> its QDQ form. A quantizer not listed has no exact QDQ equivalent.
QDQ_FORMS: dict[str, Callable[[Quantizer], Qdq]] = {"uniform": _uniform, "uniform_sym": _uniform_sym}


def qdq_for(q: Quantizer) -> Qdq | None:
    """The QDQ form of a calibrated quantizer, or None where standard ONNX cannot express it."""
    form = QDQ_FORMS.get(q.name)
    return form(q) if form is not None and q.bits <= 16 else None


class _Mark(torch.autograd.Function):
    """Identity in torch; an opaque ``vizq::Mark(idx)`` node in the exported graph."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, idx: int) -> torch.Tensor:  # noqa: ARG004
        return x.clone()

    @staticmethod
    def symbolic(g: Any, x: Any, idx: int) -> Any:
        return g.op("vizq::Mark", x, idx_i=idx).setType(x.type())


class _MarkedLinear(nn.Module):
    """``x @ Wᵀ + b`` with Wᵀ stored pre-transposed and marked (DQ feeds MatMul directly)."""

    def __init__(self, lin: nn.Linear, idx: int) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(lin.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = lin.bias
        self.idx = idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, _Mark.apply(self.weight_t, self.idx))
        return y if self.bias is None else y + self.bias


class _MarkedConv(nn.Module):
    def __init__(self, conv: nn.Conv2d, idx: int) -> None:
        super().__init__()
        self.conv = conv
        self.idx = idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.conv
        return nn.functional.conv2d(x, _Mark.apply(c.weight, self.idx), c.bias, c.stride, c.padding, c.dilation, c.groups)


@dataclass
class Entry:
    """One marker: the site it stands for, its QDQ form, and for weights the weight layout's axis."""

    site: str
    qdq: Qdq
    weight: bool


@dataclass
class Graph:
    """The finished ONNX graph (serialized) and what each site became."""

    model: bytes
    entries: list[Entry] = field(default_factory=list)

    def site_outputs(self) -> dict[str, str]:
        """Activation site -> the name of its first DequantizeLinear output in the graph."""
        out: dict[str, str] = {}
        for i, e in enumerate(self.entries):
            if not e.weight:
                out.setdefault(e.site, _dq_name(i))
        return out


def _dq_name(i: int) -> str:
    return f"vizq_dq_{i}"


def _set_child(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, new)


def build(qm: QuantizedModel, example: torch.Tensor) -> Graph:
    """Export ``qm`` (calibrated, every quantized site with a QDQ form) as QDQ ONNX bytes."""
    if not qm.calibrated:
        raise VizqError("calibrate the model before exporting it to ONNX")
    missing = [n for n, a in qm.acts.items() if qdq_for(a.q) is None]
    missing += [f"{p}.weight" for p, q in qm.weights.items() if qdq_for(q) is None]
    if missing:
        raise VizqError(f"{len(missing)} site(s) have no QDQ form ({', '.join(missing[:4])}…); export with "
                        "non-uniform sites kept in float or replaced by uniform (see `vizq export --help`)")
    model = copy.deepcopy(qm.model).eval().cpu()
    for m in model.modules():  # the copy carries the engine's hooks: markers replace them here
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    entries: list[Entry] = []
    for path, q in qm.weights.items():
        mod = model.get_submodule(path)
        qdq = qdq_for(q)
        if isinstance(mod, nn.Linear):
            if qdq.axis is not None:  # the weight is stored transposed: [in, out]
                qdq = Qdq(qdq.scale, qdq.zero_point, 1 - (qdq.axis % 2), qdq.bits, qdq.signed, qdq.notes)
            _set_child(model, path, _MarkedLinear(mod, len(entries)))
        elif isinstance(mod, nn.Conv2d):
            if qdq.axis is not None:
                qdq = Qdq(qdq.scale, qdq.zero_point, qdq.axis % 4, qdq.bits, qdq.signed, qdq.notes)
            _set_child(model, path, _MarkedConv(mod, len(entries)))
        else:
            raise VizqError(f"{path}: a {type(mod).__name__} weight cannot be exported to ONNX QDQ")
        entries.append(Entry(f"{path}.weight", qdq, True))

    index: dict[str, int] = {}

    def mark(site: Any, x: torch.Tensor) -> torch.Tensor:
        aq = qm.acts[site.name]
        if site.name not in index:
            index[site.name] = len(entries)
            entries.append(Entry(site.name, qdq_for(aq.q), False))
        y = x
        if aq.ratio is not None:
            y = y / aq.ratio.to(y) - aq.delta.to(y)
        if aq.shift:
            y = y + aq.shift
        y = _Mark.apply(y, index[site.name])
        return y - aq.shift if aq.shift else y

    buf = io.BytesIO()
    with site_hooks(model, qm._hook_sites(), mark), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example.cpu(),), buf, dynamo=False, opset_version=_EXPORT_OPSET,
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                          custom_opsets={"vizq": 1}, do_constant_folding=True)
    return Graph(_replace_marks(buf.getvalue(), entries), entries)


def _onnx_type(q: Qdq) -> int:
    from onnx import TensorProto

    return {(4, False): TensorProto.UINT4, (4, True): TensorProto.INT4, (8, False): TensorProto.UINT8,
            (8, True): TensorProto.INT8, (16, False): TensorProto.UINT16, (16, True): TensorProto.INT16}[
        (q.container, q.signed)]


def _tensor(name: str, values: np.ndarray, dtype: int) -> Any:
    from onnx import helper

    return helper.make_tensor(name, dtype, list(values.shape), values.reshape(-1).tolist())


def _broadcast(v: np.ndarray, axis: int | None, rank: int) -> np.ndarray:
    if axis is None or v.ndim == 0:
        return v
    shape = [1] * rank
    shape[axis % rank] = v.shape[0]
    return v.reshape(shape)


def _replace_marks(data: bytes, entries: list[Entry]) -> bytes:
    """Swap every ``vizq::Mark`` for its QDQ pair (weights: integer initializer + DQ)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m = onnx.load_from_string(data)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    consts = {n.output[0]: n for n in g.node if n.op_type == "Constant"}
    nodes, drop = [], set()
    for node in g.node:
        if not (node.domain == "vizq" and node.op_type == "Mark"):
            nodes.append(node)
            continue
        i = next(a.i for a in node.attribute if a.name == "idx")
        e = entries[i]
        q = e.qdq
        src, out, name = node.input[0], node.output[0], f"vizq_{i}"
        ax = {} if q.axis is None else {"axis": q.axis}
        new = [_tensor(f"{name}_scale", q.scale.astype(np.float32), TensorProto.FLOAT),
               _tensor(f"{name}_zp", q.zero_point.astype(np.int64), _onnx_type(q))]
        if e.weight:
            w = numpy_helper.to_array(inits[src]) if src in inits else numpy_helper.to_array(consts[src].attribute[0].t)
            s = _broadcast(q.scale.astype(np.float64), q.axis, w.ndim)
            z = _broadcast(q.zero_point.astype(np.float64), q.axis, w.ndim)
            ints = np.round(w.astype(np.float64) / s) + z
            lo, hi = q.qrange
            if ints.min() < lo or ints.max() > hi:
                raise VizqError(f"{e.site}: weight codes fall outside {lo}..{hi}; the calibrated state is inconsistent")
            new.append(_tensor(f"{name}_w", ints.astype(np.int64), _onnx_type(q)))
            nodes.append(helper.make_node("DequantizeLinear", [f"{name}_w", f"{name}_scale", f"{name}_zp"], [out],
                                          name=f"{name}_dq", **ax))
            drop.add(src)
        else:
            x = src
            if q.clipped:  # a b-bit grid in a wider container: clip to the grid's ends first
                lo, hi = q.qrange
                s, z = q.scale.astype(np.float64), q.zero_point.astype(np.float64)
                new += [_tensor(f"{name}_lo", ((lo - z) * s).astype(np.float32), TensorProto.FLOAT),
                        _tensor(f"{name}_hi", ((hi - z) * s).astype(np.float32), TensorProto.FLOAT)]
                if q.axis is not None:  # per-axis bounds broadcast from the (negative) axis onward
                    for t in new[-2:]:
                        t.dims[:] = [t.dims[0]] + [1] * (-q.axis - 1)
                nodes += [helper.make_node("Max", [x, f"{name}_lo"], [f"{name}_max"], name=f"{name}_clip_lo"),
                          helper.make_node("Min", [f"{name}_max", f"{name}_hi"], [f"{name}_clip"], name=f"{name}_clip_hi")]
                x = f"{name}_clip"
            nodes += [helper.make_node("QuantizeLinear", [x, f"{name}_scale", f"{name}_zp"], [f"{name}_q"],
                                       name=f"{name}_q", **ax),
                      helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_scale", f"{name}_zp"], [_dq_name(i)],
                                       name=f"{name}_dq", **ax),
                      helper.make_node("Identity", [_dq_name(i)], [out], name=f"{name}_out")]
        g.initializer.extend(new)
    del g.node[:]
    g.node.extend(nodes)
    used = {n for node in g.node for n in node.input}
    keep = [t for t in g.initializer if t.name in used or t.name not in drop]
    del g.initializer[:]
    g.initializer.extend(keep)
    live = [n for n in g.node if not (n.op_type == "Constant" and n.output[0] in drop and n.output[0] not in used)]
    del g.node[:]
    g.node.extend(live)
    for op in m.opset_import:
        if op.domain in ("", "ai.onnx"):
            op.version = OPSET
    kept = [op for op in m.opset_import if op.domain != "vizq"]
    del m.opset_import[:]
    m.opset_import.extend(kept)
    m.producer_name = "vizq"
    onnx.checker.check_model(m, full_check=True)
    return m.SerializeToString()
