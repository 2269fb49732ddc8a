"""The bench scripts start as the README runs them (``.venv/bin/python bench/x.py`` from the
repository root, where only ``bench/`` is on the path): each one's ``--help`` exits 0."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_bench_script_finds_vizq_when_run_as_a_script():
    scripts = sorted((ROOT / "bench").glob("*.py"))
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for p in scripts}
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            failed[name] = err.strip().splitlines()[-1:]
    assert len(scripts) >= 6 and not failed, failed
