"""The service layer: what a user asks of vizq, each one call.

``calibrate``, ``evaluate``, ``export`` / ``export_zip`` / ``reload``, ``deploy`` (ONNX),
``sensitivity`` and ``counts`` (what a run will use) — each takes
the loaded model, a :class:`QuantConfig`, a :class:`DataSpec` and a :class:`Run` (device,
progress, cancel). The CLI and every dashboard page call only these: no page builds a
calibration batch or decides which data to use, so the data a result reports is the data the
run used. Progress comes as one phase-aware line ("calibrating k/N steps", a step being a
quantizer calibrated, the fold or a GPTAQ layer; then "evaluating k/N images"), each phase
with its own ETA.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ..data import DataError
from ..dataspec import DataSpec
from ..dist import Context
from ..family import LoadedModel
from ..errors import InputError
from ..progress import Run
from .config import QuantConfig
from .engine import QuantizedModel
from .evaluate import Calibration, EvalResult, calibrate_shared, run_eval
from .evaluate import sensitivity as _sensitivity

__all__ = ["By", "Counts", "Mode", "Run", "calibrate", "counts", "evaluate", "export", "export_zip", "deploy", "sensitivity", "reload"]


class By(str, Enum):
    """Sensitivity groups: one site kind, or one residual block."""

    KIND = "kind"
    BLOCK = "block"


class Mode(str, Enum):
    """Sensitivity: quantize only the group, or everything but it."""

    ONLY = "only"
    ALL_BUT = "all_but"


def _units(loaded: LoadedModel) -> str:
    return "sentences" if loaded.info.modality == "text" else "images"


def calibrate(loaded: LoadedModel, config: QuantConfig, data: DataSpec, run: Run | None = None, for_eval: bool = True,
              ctx: Context | None = None) -> Calibration:
    """A calibrated model on ``data``'s calibration samples (see ``evaluate.calibrate``)."""
    run = run or Run()
    ctx = ctx or Context(device=str(run.device))
    return calibrate_shared(loaded, config, DataSpec.of(data), ctx, progress=run.phase("calibrating", "steps"),
                            cancel=run.cancel, for_eval=for_eval,
                            recon_progress=run.phase("reconstructing", "steps"))


def evaluate(loaded: LoadedModel, config: QuantConfig, data: DataSpec, n_eval: int, run: Run | None = None,
             qmodel: QuantizedModel | None = None, batch_size: int = 64, ctx: Context | None = None) -> EvalResult:
    """Calibrate (unless ``qmodel`` is given, e.g. reloaded from an export), then evaluate on
    held-out samples of the same ``data``; the result records ``data`` and the counts used."""
    run = run or Run()
    if n_eval < 1:
        raise InputError(f"evaluate at least 1 {_units(loaded)[:-1]}, not {n_eval}")
    res, qm = run_eval(loaded, config, DataSpec.of(data), n_eval, str(run.device), batch_size,
                       progress=run.phase("evaluating", _units(loaded)), cancel=run.cancel, qmodel=qmodel, ctx=ctx,
                       calib_progress=run.phase("calibrating", "steps"),
                       recon_progress=run.phase("reconstructing", "steps"))
    if qmodel is None:
        qm.remove_hooks()
    return res


@dataclass(frozen=True)
class Counts:
    """How many samples a run on ``data`` will really use (before any file is decoded)."""

    pool: int  # the samples evaluation draws from (the held-out part where the family splits)
    calib: int
    eval: int
    own_split: bool  # calibration comes from a separate part (the digits' training split)


def counts(loaded: LoadedModel, config: QuantConfig, data: DataSpec, n_eval: int) -> Counts:
    """What an evaluation of ``n_eval`` would use: the page says it before the run, so "500"
    never reads as 500 on a folder of 17 photographs."""
    from .evaluate import calib_count, eval_split

    spec = DataSpec.of(data)
    pool = len(spec.open(loaded, "eval"))
    if spec.own_split(loaded):
        n_cal = min(config.calibration.images, len(spec.open(loaded, "calib")))
    else:
        n_cal = calib_count(pool, config.calibration.images)
    try:
        _, idx = eval_split(loaded, config, spec, n_eval)
    except DataError:
        idx = []
    return Counts(pool, n_cal, len(idx), spec.own_split(loaded))


def export(loaded: LoadedModel, config: QuantConfig, data: DataSpec, out: str | Path, run: Run | None = None,
           force: bool = False) -> Path:
    """Calibrate on ``data`` (the count asked: nothing is held out) and write a vizq export
    folder atomically; its manifest names the data source and the samples used."""
    from .export import check_destination
    from .export import export as write_export

    check_destination(out, force)
    spec = DataSpec.of(data)
    cal = calibrate(loaded, config, spec, run, for_eval=False)
    with cal.qmodel:
        return write_export(cal.qmodel, out, cal.image_ids, force=force, skipped=cal.skipped,
                            manifest_extra={"data": spec.record()})


@dataclass
class Archive:
    """An export as the dashboard offers it: the zip, and the calibration's report."""

    zip: bytes
    params_json: bytes
    aimet_json: bytes
    calib_images: int
    skipped: list[str]


def export_zip(loaded: LoadedModel, config: QuantConfig, data: DataSpec, run: Run | None = None) -> Archive:
    """:func:`export` into a temporary folder, zipped; :func:`reload` reads the zip back as it is."""
    from .export import zip_folder

    with tempfile.TemporaryDirectory() as tmp:
        out = export(loaded, config, data, Path(tmp) / "vizq-export", run)
        m = json.loads((out / "manifest.json").read_text())
        return Archive(zip_folder(out, "vizq-export"), (out / "quant_params.json").read_bytes(),
                       (out / "aimet_encodings.json").read_bytes(), len(m["calibration_image_ids"]),
                       list(m.get("skipped_files", [])))


def reload(loaded: LoadedModel, path: str | Path) -> QuantizedModel:
    """A calibrated model from an export folder or its zip, bit-exactly (no recalibration)."""
    from .export import load_export

    return load_export(path, loaded)


def deploy(loaded: LoadedModel, config: QuantConfig, data: DataSpec, non_uniform: Any, check_images: int,
           run: Run | None = None, batch_size: int = 32) -> Any:
    """The deployable ONNX QDQ form of ``config``, calibrated on ``data`` and checked in ONNX
    Runtime on ``check_images`` held-out samples (see ``vizq.ptq.deploy.prepare``)."""
    from .deploy import prepare

    run = run or Run()
    return prepare(loaded, config, DataSpec.of(data), non_uniform, check_images, run.device, batch_size,
                   progress=run.phase("checking in ONNX Runtime", "images"), cancel=run.cancel,
                   calib_progress=run.phase("calibrating", "steps"))


def sensitivity(loaded: LoadedModel, config: QuantConfig, data: DataSpec, n_eval: int, by: By = By.KIND,
                mode: Mode = Mode.ONLY, run: Run | None = None) -> list[dict[str, Any]]:
    """Rank site kinds or blocks by what quantizing them (alone, or all but them) costs."""
    run = run or Run()
    return _sensitivity(loaded, config, DataSpec.of(data), n_eval, By(by).value, Mode(mode).value, str(run.device),
                        progress=run.phase("ranking sensitivity", "groups"), cancel=run.cancel)
