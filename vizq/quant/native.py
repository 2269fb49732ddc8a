"""An optional compiled CPU kernel for step functions and block formats, built on first use.

Why: on CPU, fake-quantizing activations with torch ops costs one or more full passes per
site (a binary search for log/float grids), which made a quantized ViT evaluate at well under
0.7× float speed. One C loop (``_native.c``) does the same lookup several times faster. It is
plain C called through ctypes (no torch headers, builds in well under a second), cached per
machine, and entirely optional: without a compiler, or with ``VIZQ_NATIVE=0``, every caller
falls back to torch ops that give bit-identical results (tested).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("_native.c")
FLAGS = ["-O3", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off"]

_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()  # the dashboard calibrates in background threads


def enabled() -> bool:
    """False when the user turned the kernel off (``VIZQ_NATIVE=0``)."""
    return os.environ.get("VIZQ_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    return Path(os.environ.get("VIZQ_CACHE_DIR") or Path.home() / ".cache" / "vizq")


def _build(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        err = ""
        for extra in (["-fopenmp"], []):  # without OpenMP the kernel runs on one thread
            r = subprocess.run([cc, *FLAGS, *extra, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                               timeout=120)
            if r.returncode == 0:
                os.replace(tmp, out)  # atomic: a concurrent loader sees no file or the whole new one
                return
            err = r.stderr.strip()[:500]
        raise RuntimeError(f"{cc} failed: {err}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it once if needed; None when unavailable."""
    global _lib, _tried
    if not enabled() or sys.platform == "win32":
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            _lib = _load()
            _tried = True
    return _lib


def _load() -> ctypes.CDLL | None:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    path = cache_dir() / f"native-{key}.so"
    try:
        if not path.exists():
            _build(path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged or foreign cached file: rebuild it once
            _build(path)
            lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"vizq: compiled quantization kernel unavailable ({e}); using torch ops "
                      "(same results, slower on CPU)", RuntimeWarning, stacklevel=3)
        return None
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.vizq_step_apply.restype = lib.vizq_block_apply.restype = None
    lib.vizq_step_apply.argtypes = [ptr, ptr, i64, ptr, i32, ptr, ptr]
    lib.vizq_block_apply.argtypes = [ptr, ptr, i64, i64, i32, ptr, i32, ptr, ptr, i32, i32, ptr, i32, ptr, ptr,
                                     ctypes.c_float]
    return lib


def available() -> bool:
    return library() is not None


def kernel_for(device: str | torch.device) -> str:
    """Which fake-quant path runs on ``device``: "compiled" (this kernel) or "torch"."""
    return "compiled" if torch.device(device).type == "cpu" and available() else "torch"


def _runnable(x: torch.Tensor) -> ctypes.CDLL | None:
    lib = library()
    return lib if lib is not None and x.device.type == "cpu" and x.dtype == torch.float32 else None


def _args(step) -> tuple[int, int, int, int]:  # noqa: ANN001 - a StepFunction
    """What the C side takes for one step function: table, shift, NaN-padded thresholds, levels."""
    return step.table.data_ptr(), step.shift, step.padded.data_ptr(), step.levels.data_ptr()


def step_apply(x: torch.Tensor, step) -> torch.Tensor | None:  # noqa: ANN001 - a StepFunction
    """``step.levels[#thresholds <= x]`` for a CPU float32 tensor, or None when the kernel cannot run."""
    lib = _runnable(x)
    if lib is None or step.table is None:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.vizq_step_apply(x.data_ptr(), out.data_ptr(), x.numel(), *_args(step))
    return out


def block_apply(x: torch.Tensor, block: int, element, scale_step=None, emax: int = 0,  # noqa: ANN001
                tensor_scale: float = 1.0) -> torch.Tensor | None:
    """Block-scaled fake quantization along the last dim (see ``_native.c``), or None.

    ``element``/``scale_step`` are StepFunctions: the element format's rounding and, for NVFP4
    (``scale_step`` given), the E4M3 rounding of block scales; without ``scale_step`` scales
    are MX powers of two with the element format's ``emax``.
    """
    lib = _runnable(x)
    if lib is None or element.table is None or (scale_step is not None and scale_step.table is None) or x.dim() == 0:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    cols = x.shape[-1]
    mode = 0 if scale_step is None else 1
    lib.vizq_block_apply(x.data_ptr(), out.data_ptr(), x.numel() // max(cols, 1), cols, block, *_args(element),
                         mode, emax, *_args(scale_step or element), float(tensor_scale))
    return out
