"""One honest progress line for long work: phase, count, unit, ETA — and the way to stop it.

Library functions take a plain callback ``progress(done, total, detail)`` for *one* phase. A
:class:`Reporter` hands out one such callback per phase ("calibrating … sites", then
"evaluating … images"), each with its own clock, and turns every call into a :class:`Step`
for whoever shows it (the CLI's bar, the dashboard's line). Each call also checks ``cancel``,
so a cancel takes effect at the next site or batch, not at the end of the run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import Cancelled

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Step:
    """Where a run is: ``done`` of ``total`` ``unit`` in ``phase``; ``eta`` in seconds (None
    until the first unit is done: an ETA from nothing would be a guess)."""

    phase: str
    done: int
    total: int
    unit: str
    detail: str = ""
    eta: float | None = None

    @property
    def fraction(self) -> float:
        return min(self.done / self.total, 1.0) if self.total else 0.0

    def line(self) -> str:
        parts = [f"{self.phase} {self.done}/{self.total} {self.unit}" if self.total else f"{self.phase}…"]
        if self.detail:
            parts.append(self.detail)
        if self.total and self.done < self.total:
            parts.append(f"ETA {self.eta:.0f} s" if self.eta is not None else "ETA ?")
        return " · ".join(parts)


Sink = Callable[[Step], None]


class Reporter:
    """Per-phase callbacks feeding one :class:`Step` stream; see the module docstring."""

    def __init__(self, sink: Sink | None = None, cancel: Callable[[], bool] | None = None) -> None:
        self.sink = sink
        self.cancel = cancel

    def check(self) -> None:
        if self.cancel is not None and self.cancel():
            raise Cancelled("cancelled; nothing was written")

    def phase(self, name: str, unit: str) -> Progress:
        """The callback for phase ``name``. Its clock starts at its first call, and the rate is
        measured from there: units already done at that call took unknown time, so they do not
        count (a phase first reported at 1/100 must not claim ETA 0 s)."""
        marks: list[tuple[float, int]] = []  # (time, done) at the phase's start and at the last call

        def report(done: int, total: int, detail: str = "") -> None:
            self.check()
            now = time.time()
            if not marks or done < marks[1][1]:  # first call, or the phase started over (a second pass)
                marks[:] = [(now, done), (now, done)]
            t0, d0 = marks[0]
            marks[1] = (now, done)
            eta = (now - t0) / (done - d0) * (total - done) if total and d0 < done < total else None
            if self.sink is not None:
                self.sink(Step(name, done, total, unit, detail, eta))

        return report


@dataclass
class Run:
    """How a service call runs: on which device, where its progress goes, how to stop it."""

    device: str | torch.device = "cpu"
    on_step: Sink | None = None
    cancel: Callable[[], bool] | None = None
    reporter: Reporter = field(init=False)

    def __post_init__(self) -> None:
        self.reporter = Reporter(self.on_step, self.cancel)

    def phase(self, name: str, unit: str) -> Progress:
        return self.reporter.phase(name, unit)
