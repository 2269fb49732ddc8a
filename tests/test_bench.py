"""The bench scripts start as the README runs them (``.venv/bin/python bench/x.py`` from the
repository root, where only ``bench/`` is on the path, not the root): each one's module body
(its imports) runs in an isolated interpreter that cannot see the repository otherwise."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOAD = ("import runpy, sys\n"
        "assert not any(p in ('', '.') for p in sys.path)\n"
        "path = list(sys.path)\n"
        "for f in sys.argv[1:]:\n"
        "    sys.path[:] = path  # what one script put there is not there for the next\n"
        "    for m in [m for m in sys.modules if m == 'vizq' or m.startswith('vizq.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        runpy.run_path(f)  # not as __main__: the imports, not the benchmark\n"
        "    except ImportError as e:\n"
        "        sys.exit(f'{f}: {e}')\n")


def test_every_bench_script_finds_vizq_when_run_as_a_script():
    scripts = sorted(str(p) for p in (ROOT / "bench").glob("*.py"))
    assert len(scripts) >= 6
    # -I: no current directory and no PYTHONPATH on the path, as for `python bench/x.py`
    p = subprocess.run([sys.executable, "-I", "-c", LOAD, *scripts], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
