"""Config sweeps: presets × bit widths × override sets, one whole job per rank at a time.

Each job is an ordinary single-process evaluation, so its numbers equal ``vizq eval`` with the
same settings. Under torchrun job ``i`` runs on rank ``i mod world``; with one process the
jobs simply run in turn. Every finished job lands atomically as ``OUT/<job>.json`` and in the
run history (so the dashboard's Evaluate page shows it as it arrives); a rerun skips jobs whose
file is already there, which is how a crashed or cancelled sweep resumes. The merged
``results.json``/``results.csv`` are written by rank 0 once every rank is done.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import atomic, dist
from .errors import InputError
from .ptq.config import QuantConfig, overrides_from_rules
from .runs import append_run

RESULT_KEYS = ("job", "preset", "wbits", "abits", "overrides", "calib_images", "eval_images", "fp_top1", "q_top1",
               "fp_top5", "q_top5", "agreement", "kl", "seconds_calibrate", "seconds_eval", "status")


@dataclass(frozen=True)
class Job:
    """One evaluation of the sweep: a preset, widths and a set of override rules."""

    preset: str
    wbits: int
    abits: int
    rules: tuple[str, ...]
    config: QuantConfig

    @property
    def id(self) -> str:
        """Stable file name: the same job always maps to the same file (resume)."""
        base = f"{self.preset}-w{self.wbits}a{self.abits}"
        if not self.rules:
            return base
        return f"{base}-{hashlib.sha1(';'.join(self.rules).encode()).hexdigest()[:8]}"


def _bits(text: str) -> tuple[int, int]:
    try:
        w, a = (int(v) for v in text.split("/"))
    except ValueError:
        raise InputError(f"--bits {text!r}: write W/A pairs such as 4/4,6/6,8/8") from None
    return w, a


def plan_jobs(methods: list[str], bits: list[str], override_sets: list[str], common: list[str], *,
              calib: int = 32, seed: int = 0, batch_size: int = 32) -> list[Job]:
    """Every (method, W/A, override set) combination, validated before anything runs."""
    jobs = []
    for m in (m.strip() for m in methods if m.strip()):
        for w, a in (_bits(b.strip()) for b in bits if b.strip()):
            for s in override_sets:
                rules = tuple(common) + tuple(r.strip() for r in s.split(";") if r.strip())
                cfg = QuantConfig(preset=m, wbits=w, abits=a, overrides=overrides_from_rules(list(rules)),
                                  calibration={"images": calib, "seed": seed, "batch_size": batch_size})
                jobs.append(Job(m, w, a, rules, cfg))
    if not jobs:
        raise InputError("the sweep has no jobs: give at least one preset and one W/A pair")
    ids = [j.id for j in jobs]
    if len(set(ids)) != len(ids):
        raise InputError("the sweep lists the same job twice; remove the repeated preset, width or override set")
    return jobs


MARKER = ".vizq-sweep"


def claim_folder(out: Path) -> None:
    """Make ``out`` a sweep folder, or refuse: a folder that exists, holds files and was not
    started by a sweep is the user's, and job or results files must not overwrite theirs."""
    from .errors import DestinationError

    if out.is_dir() and not (out / MARKER).exists() and any(out.iterdir()):
        raise DestinationError(f"{out} holds files and is not a vizq sweep folder; vizq never overwrites what it "
                               "did not write. Choose a new or empty --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).touch()


def _done(path: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("status") == "done" else None


def run_sweep(loaded: Any, jobs: list[Job], out: str | Path, data: str | None, n_eval: int, ctx: dist.Context,
              log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run this rank's jobs (skipping finished ones), then, on rank 0, merge all results."""
    from .progress import Run
    from .ptq import service

    out = Path(out)
    claim_folder(out)
    dist.barrier(ctx)
    for i, job in enumerate(jobs):
        if i % ctx.world != ctx.rank:
            continue
        path = out / f"{job.id}.json"
        if _done(path) is not None:
            if log:
                log(f"[{i + 1}/{len(jobs)}] {job.id}: already done, skipped")
            continue
        res = service.evaluate(loaded, job.config, data, n_eval, Run(ctx.device),
                               batch_size=job.config.calibration.batch_size)
        tags = {"job": job.id, "overrides": list(job.rules), "status": "done", "rank": ctx.rank}
        atomic.write_json(path, {**res.to_dict(), **tags})
        append_run({**res.to_dict(per_site=False), **tags, "source": f"sweep:{out.name}"})
        if log:
            log(f"[{i + 1}/{len(jobs)}] {job.id}: top-1 {res.q_top1}, agreement {res.agreement:.2f}%")
    dist.barrier(ctx)
    if not ctx.main:
        return []
    rows = []
    for job in jobs:
        rec = _done(out / f"{job.id}.json") or {"job": job.id, "preset": job.preset, "wbits": job.wbits,
                                                 "abits": job.abits, "status": "missing"}
        rows.append({k: (";".join(rec.get(k) or []) if k == "overrides" else rec.get(k)) for k in RESULT_KEYS})
    atomic.write_json(out / "results.json", rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(RESULT_KEYS))
    w.writeheader()
    w.writerows(rows)
    atomic.write_text(out / "results.csv", buf.getvalue())
    return rows
