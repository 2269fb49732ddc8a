"""Device names the user types (``auto``, ``cpu``, ``cuda:1``, ``mps``) to torch devices."""
from __future__ import annotations

import torch

from .errors import InputError


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda``/``cuda:N``, ``mps``; anything else, or a
    device this machine does not have, is an :class:`InputError` naming what is available."""
    have = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        have.append("mps")
    hint = f"use auto or one of: {', '.join(have)}"
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise InputError(f"--device {name!r} is not a device name; {hint}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise InputError(f"--device {name} was asked for but this machine has no such CUDA device; {hint}")
    if dev.type not in ("cpu", "cuda") and str(dev) not in have:
        raise InputError(f"--device {name} is not available here; {hint}")
    return dev


def describe(device: str | torch.device = "cpu") -> dict[str, object]:
    """The hardware a number was computed on, recorded next to it (eval results, exports).

    Why: the same code, model, images and seed give slightly different float rounding on
    another CPU (its vector width picks other matmul kernels), and at 4–6 bits a few rounding
    flips move top-1 by one or two points (README: "Which CPU these figures come from"). A figure
    without its machine cannot be checked.
    """
    dev = torch.device(device)
    out: dict[str, object] = {"device": str(dev), "threads": torch.get_num_threads(),
                              "cpu": _cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if dev.type == "cuda" and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(dev)
    return out


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
