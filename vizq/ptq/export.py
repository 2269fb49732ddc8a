"""Write a calibrated configuration to a folder and load it back, bit-exactly.

Folder layout (written atomically: a failed or cancelled export leaves no folder):
- ``config.json``          the QuantConfig (reload with ``--config DIR``)
- ``quant_params.json``    per site: quantizer, bits, granularity, options, parameter summary
- ``params.safetensors``   every quantizer's parameters, plus the parameters folding changed
- ``manifest.json``        model id and weights hash, calibration image ids, seed, versions
- ``aimet_encodings.json`` uniform ranges in AIMET's encodings layout (others listed as skipped)
"""
from __future__ import annotations

import io
import json
import platform
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save
from torch import nn

from .. import __version__, atomic
from ..device import describe
from ..quant import get_quantizer
from .config import ConfigError, QuantConfig
from .engine import QuantizedModel
from .presets import Spec

FORMAT = "vizq-export"
FORMAT_VERSION = 1


def _versions() -> dict[str, str]:
    import numpy
    import timm

    return {"vizq": __version__, "torch": torch.__version__, "timm": timm.__version__, "numpy": numpy.__version__,
            "python": platform.python_version()}


def _granularity(q: Any) -> str:
    return q.granularity.value


def _changed_params(qm: QuantizedModel) -> dict[str, torch.Tensor]:
    """Float parameters that folding changed: LayerNorm γ/β and the consumers' weight/bias."""
    out: dict[str, torch.Tensor] = {}
    for site_name in qm.folds:
        s = next(s for s in qm.sites if s.name == site_name)
        if s.port != "consumers":  # post-LN folds leave the LayerNorm untouched
            norm = qm.model.get_submodule(s.module)
            out[f"{s.module}.weight"] = norm.weight.detach().clone()
            out[f"{s.module}.bias"] = norm.bias.detach().clone()
        for c in s.consumers:
            w = qm.fp_weights.get(c)  # unquantized consumers hold their folded weight in the model
            out[f"{c}.weight"] = (w if w is not None else qm.model.get_submodule(c).weight.detach()).clone()
            out[f"{c}.bias"] = qm.model.get_submodule(c).bias.detach().clone()
    for path in dict.fromkeys(qm.compensated + qm.recon_modules):  # weights GPTQ or reconstruction changed
        out[f"{path}.weight"] = qm.fp_weights[path].clone()
    for path in qm.recon_modules:  # ias-released trains biases too (AdaRound leaves them: the same values again)
        bias = getattr(qm.model.get_submodule(path), "bias", None)
        if bias is not None:
            out[f"{path}.bias"] = bias.detach().clone()
    return out


def aimet_encodings(qm: QuantizedModel) -> tuple[dict[str, Any], list[str]]:
    """Uniform quantizers as AIMET encodings; non-uniform sites are returned as skipped."""
    acts, params, skipped = {}, {}, []

    def enc(q: Any) -> list[dict[str, Any]] | None:
        if q.name not in ("uniform", "uniform_sym"):
            return None
        s = q.state["scale"].flatten().tolist()
        if q.name == "uniform":
            z = q.state["zero_point"].flatten().tolist()
            qmax = 2**q.bits - 1
            return [{"bitwidth": q.bits, "dtype": "int", "is_symmetric": "False", "scale": si, "offset": -zi,
                     "min": -zi * si, "max": (qmax - zi) * si} for si, zi in zip(s, z)]
        half = 2 ** (q.bits - 1)
        return [{"bitwidth": q.bits, "dtype": "int", "is_symmetric": "True", "scale": si, "offset": -half,
                 "min": -half * si, "max": (half - 1) * si} for si in s]

    for name, aq in qm.acts.items():
        e = enc(aq.q)
        (acts.__setitem__(name, e) if e else skipped.append(f"{name} ({aq.q.name})"))
    for path, q in qm.weights.items():
        e = enc(q)
        (params.__setitem__(f"{path}.weight", e) if e else skipped.append(f"{path}.weight ({q.name})"))
    return {"version": "0.6.1", "activation_encodings": acts, "param_encodings": params}, skipped


def snapshot(qm: QuantizedModel, calib_ids: list[str] | None = None,
             skipped: list[str] | None = None) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]], dict[str, Any]]:
    """Everything that defines the calibrated model, as (tensors, per-site rows, manifest):
    what an export writes, and what a torchrun rank 0 sends to the others."""
    if not qm.calibrated:
        raise ValueError("calibrate the model before exporting it")
    tensors: dict[str, torch.Tensor] = {}
    sites_json = []
    for s in qm.sites:
        if s.name in qm.acts:
            aq = qm.acts[s.name]
            q, key, shift = aq.q, f"act/{s.name}", aq.shift
        elif s.kind == "weight" and s.module in qm.weights:
            q, key, shift = qm.weights[s.module], f"weight/{s.module}", 0.0
        else:
            continue
        for k, v in q.state.items():
            tensors[f"{key}/{k}"] = v.detach().cpu().contiguous()
        aq = qm.acts.get(s.name)
        if aq is not None and aq.ratio is not None:
            tensors[f"fold/{s.name}/ratio"] = aq.ratio.detach().cpu().contiguous()
            tensors[f"fold/{s.name}/delta"] = aq.delta.detach().cpu().contiguous()
        sites_json.append({
            "site": s.name, "kind": s.kind, "quantizer": q.name, "bits": q.bits, "granularity": _granularity(q),
            "options": q.options, "axis": q.axis, "shift": shift, "folded": s.name in qm.folds,
            "summary": {k: {"min": float(v.min()), "max": float(v.max()), "count": v.numel()} for k, v in q.state.items()},
        })
    for k, v in _changed_params(qm).items():
        tensors[f"model/{k}"] = v.detach().cpu().contiguous()
    _, aimet_skipped = aimet_encodings(qm)
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model_id": qm.info.model_id, "weights_sha256": qm.info.weights_sha256,
        "calibration_image_ids": list(calib_ids or getattr(qm, "calib_ids", [])),
        "seed": qm.config.calibration.seed, "versions": _versions(), "machine": describe(next(qm.model.parameters()).device),
        "aimet_skipped": aimet_skipped,
        "folded_sites": list(qm.folds),
        "recon_modules": list(qm.recon_modules),
        "gptq_modules": list(qm.compensated),
        "skipped_files": list(skipped or []),
    }
    return tensors, sites_json, manifest


def export(qm: QuantizedModel, out_dir: str | Path, calib_ids: list[str] | None = None, force: bool = False,
           skipped: list[str] | None = None, extra: dict[str, bytes] | None = None,
           manifest_extra: dict[str, Any] | None = None) -> Path:
    """Write the folder; returns its path. An existing ``out_dir`` is replaced only if it is a
    vizq export (or with ``force``); ``skipped`` names calibration files that could not be read.
    ``extra`` files (e.g. ``model.onnx``) are committed in the same atomic step as the rest."""
    tensors, sites_json, manifest = snapshot(qm, calib_ids, skipped)
    manifest.update(manifest_extra or {})
    enc, _ = aimet_encodings(qm)
    with atomic.atomic_dir(out_dir, is_ours=is_export, force=force) as tmp:
        (tmp / "config.json").write_text(qm.config.to_json() + "\n")
        (tmp / "quant_params.json").write_text(json.dumps({"sites": sites_json}, indent=2) + "\n")
        # bytes first, then Python's I/O: a full disk surfaces as OSError(ENOSPC), not a SafetensorError
        (tmp / "params.safetensors").write_bytes(save(tensors, metadata={"format": FORMAT}))
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "aimet_encodings.json").write_text(json.dumps(enc, indent=2) + "\n")
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
    return Path(out_dir)


def check_destination(out: str | Path, force: bool = False) -> None:
    """Refuse, before any work, an ``out`` that an export may not replace: a file, or a folder
    that holds something other than a vizq export (unless ``force``)."""
    from ..errors import DestinationError

    p = Path(out).expanduser()
    atomic.recover_dir(p, is_export)
    if p.exists() and not p.is_dir():
        raise DestinationError(f"{p} is a file; vizq writes a folder there and will not replace a file. Choose another --out")
    if p.is_dir() and not force and not is_export(p) and any(p.iterdir()):
        raise DestinationError(f"{p} exists and is not a vizq export; vizq never overwrites folders it did not write. "
                               "Choose a new --out, or pass --force to replace it")


def is_export(path: Path) -> bool:
    """True if ``path`` holds a vizq export (so a new export may replace it)."""
    try:
        return json.loads((Path(path) / "manifest.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(path: str | Path) -> dict[str, Any]:
    atomic.recover_dir(path, is_export)  # an export whose commit was killed comes back first
    p = Path(path) / "manifest.json"
    if not p.is_file():
        raise ConfigError(f"{path} is not a vizq export (no manifest.json); export one with `python -m vizq export`")
    m = read_json(p)
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("version"), int) \
            or m["version"] > FORMAT_VERSION:
        raise ConfigError(f"{path}: not a vizq export this version can read (format {m.get('format') if isinstance(m, dict) else '?'})")
    return m


def read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p.parent.name}/{p.name} is damaged or unreadable ({e}); export again") from None


def zip_folder(folder: Path, arcname: str) -> bytes:
    """``folder``'s files as a zip under ``arcname/`` (what the dashboard offers for download;
    :func:`load_export` reads it back as it is)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(Path(folder).iterdir()):
            z.write(f, f"{arcname}/{f.name}")
    return buf.getvalue()


@contextmanager
def opened(path: str | Path) -> Iterator[Path]:
    """An export folder, or a zip of one (as the dashboard downloads it) unpacked to a temporary
    folder for the duration. Only plain member names are extracted (no ``..``, no absolute paths)."""
    p = Path(path)
    if not (p.is_file() and zipfile.is_zipfile(p)):
        yield p
        return
    with zipfile.ZipFile(p) as z, tempfile.TemporaryDirectory() as tmp:
        names = [n for n in z.namelist() if not n.endswith("/")]
        bad = [n for n in names if n.startswith("/") or ".." in Path(n).parts]
        if bad:
            raise ConfigError(f"{p.name} holds unsafe member names ({bad[0]!r}); it is not a vizq export")
        manifests = [n for n in names if Path(n).name == "manifest.json"]
        if len(manifests) != 1:
            raise ConfigError(f"{p.name} is not a zipped vizq export (expected one manifest.json, found {len(manifests)})")
        root = str(Path(manifests[0]).parent)
        for n in names:
            if str(Path(n).parent) == root:
                (Path(tmp) / Path(n).name).write_bytes(z.read(n))
        yield Path(tmp)


@torch.no_grad()
def load_export(path: str | Path, loaded: Any) -> QuantizedModel:
    """Rebuild the calibrated quantized model without recalibration (bit-identical outputs).
    ``path``: an export folder or its zip."""
    with opened(path) as folder:
        return _load_folder(Path(folder), loaded, Path(path).name)


def _load_folder(path: Path, loaded: Any, name: str) -> QuantizedModel:
    man = read_manifest(path)
    config = QuantConfig.load(path / "config.json")
    info = read_json(path / "quant_params.json")
    if not isinstance(info, dict) or not isinstance(info.get("sites"), list):
        raise ConfigError(f"{path.name}/quant_params.json has no site list; export again")
    try:
        tensors = load_file(str(path / "params.safetensors"))
    except Exception as e:  # noqa: BLE001 - any reader failure means a damaged file
        raise ConfigError(f"{path.name}/params.safetensors is damaged or missing ({e}); export again") from None
    try:
        return restore(loaded, config, tensors, info["sites"], man, source=name)
    except (KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:  # a hand-edited or damaged file
        raise ConfigError(f"{name} does not fit this model or is damaged ({type(e).__name__}: {e}); export again") from None


@torch.no_grad()
def restore(loaded: Any, config: QuantConfig, tensors: dict[str, torch.Tensor], info: list[dict[str, Any]],
            man: dict[str, Any], source: str = "the snapshot") -> QuantizedModel:
    """The calibrated model from a :func:`snapshot` (bit-identical to the one it was taken of)."""
    if man["weights_sha256"] != loaded.info.weights_sha256:
        raise ConfigError(
            f"{source} was calibrated for {man['model_id']} (weights {man['weights_sha256'][:12]}…), "
            f"but the loaded model is {loaded.info.model_id} ({loaded.info.weights_sha256[:12]}…); load the same weights"
        )
    qm = QuantizedModel(loaded, config)
    for k, v in tensors.items():  # folded float parameters first
        if not k.startswith("model/"):
            continue
        name = k[len("model/"):]
        mod_path, pname = name.rsplit(".", 1)
        mod = qm.model.get_submodule(mod_path)
        if pname == "bias" and getattr(mod, "bias", None) is None:
            mod.bias = nn.Parameter(v.clone(), requires_grad=False)
        elif pname == "weight" and mod_path in qm.fp_weights:
            qm.fp_weights[mod_path] = v.clone()
        else:
            getattr(mod, pname).data.copy_(v)
    for row in info:
        q = get_quantizer(row["quantizer"], row["bits"], **row["options"])
        q.axis = row["axis"]
        prefix = f"act/{row['site']}/" if row["kind"] != "weight" else f"weight/{row['site'].removesuffix('.weight')}/"
        q.state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if row["kind"] == "weight":
            mod_path = row["site"].removesuffix(".weight")
            qm.weights[mod_path] = q
            qm.model.get_submodule(mod_path).weight.data.copy_(q.fake_quant(qm.fp_weights[mod_path]))
        else:
            aq = qm.acts[row["site"]]
            aq.q, aq.shift = q, row["shift"]
            if f"fold/{row['site']}/ratio" in tensors:
                aq.ratio = tensors[f"fold/{row['site']}/ratio"]
                aq.delta = tensors[f"fold/{row['site']}/delta"]
            aq.spec = Spec(q.name, q.bits, dict(q.options), row["shift"])
            aq.compile()
            if row["folded"]:
                qm.folds[row["site"]] = None  # type: ignore[assignment] - folded, factors not needed
    qm.calibrated = True
    qm.calib_ids = man["calibration_image_ids"]
    qm.recon_modules = list(man.get("recon_modules", []))
    qm.compensated = list(man.get("gptq_modules", []))
    return qm
