"""The command line end to end on the bundled model.

Commands run through ``vizq.cli.main`` in this process: a fresh interpreter costs ~6 s of torch,
torchvision and timm imports per command on this 2-core class of machine, which is most of what
these tests would measure. What only a real interpreter shows (``python -m vizq`` itself, Ctrl-C
during the import, a killed or disk-full run) is tested with real subprocesses in
``test_failures.py`` and below.
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

from vizq.cli import main

ROOT = Path(__file__).resolve().parent.parent


def vizq(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m vizq ARGS`` as the CLI's own entry function sees it: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:  # as the interpreter maps it: None is 0, a message is 1
            rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    p = subprocess.CompletedProcess(["vizq", *args], rc, out.getvalue(), err.getvalue())
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_python_dash_m_vizq_is_the_same_command():
    """One real interpreter: the module entry point runs the same command and exit code."""
    p = subprocess.run([sys.executable, "-m", "vizq", "models"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == vizq("models").stdout


def test_models_lists_loadable_and_needing_weights():
    out = vizq("models").stdout
    assert "vizq-vit-tiny" in out and "needs weights" in out and "random:swin_tiny_patch4_window7_224" in out


def test_capture_prints_summary_and_saves(tmp_path):
    p = vizq("capture", "--model", "vizq-vit-tiny", "--images", "16", "--out", str(tmp_path / "s.vizq"),
             "--json", str(tmp_path / "s.json"))
    assert "blocks.2.attn.softmax" in p.stdout and "channel_variation" in p.stdout
    assert "16/16" in p.stderr  # progress
    rows = json.loads((tmp_path / "s.json").read_text())
    assert {r["kind"] for r in rows} >= {"post_ln", "post_softmax", "post_gelu", "residual"}
    from vizq.capture import Capture

    assert Capture.load(tmp_path / "s.vizq").num_images == 16


def test_compare_reports_every_metric(tmp_path):
    vizq("compare", "--model", "vizq-vit-tiny", "--site", "blocks.2.attn.softmax", "--bits", "4",
         "--quantizers", "uniform,log2,logsqrt2,adalog,tanq,sulq,mxfp4", "--json", str(tmp_path / "c.json"))
    d = json.loads((tmp_path / "c.json").read_text())
    assert [r["quantizer"] for r in d["rows"]] == ["uniform", "log2", "logsqrt2", "adalog", "tanq", "sulq", "mxfp4"]
    for r in d["rows"]:
        assert {"mse", "sqnr_db", "cosine", "max_abs_error", "kl", "attn_output_error", "ms"} <= set(r)


def test_eval_export_and_reuse(tmp_path):
    vizq("export", "--preset", "repq", "--wbits", "4", "--abits", "4", "--out", str(tmp_path / "exp"))
    a = vizq("eval", "--preset", "repq", "--images", "60", "--json", str(tmp_path / "a.json"))
    vizq("eval", "--config", str(tmp_path / "exp"), "--images", "60", "--json", str(tmp_path / "b.json"))
    ra, rb = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert "q_top1" in a.stdout
    assert ra["q_top1"] == rb["q_top1"] and ra["kl"] == rb["kl"] and ra["agreement"] == rb["agreement"]


def test_bad_input_gives_one_clear_line():
    p = vizq("capture", "--model", "vizq-vit-tiny", "--data", "/no/such/folder", check=False)
    assert p.returncode == 2 and p.stderr.startswith("error: image folder") and "Traceback" not in p.stderr
    p = vizq("compare", "--site", "blocks.99.attn.softmax", check=False)
    assert p.returncode == 2 and "no site named" in p.stderr
    p = vizq("eval", "--override", "post_ln=warp:bits=4", check=False)
    assert p.returncode == 2 and "warp" in p.stderr and "Traceback" not in p.stderr
    p = vizq("eval", "--preset", "fp8", "--gptq", check=False)
    assert p.returncode == 2 and "gptq" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = vizq("eval", "--gptq-act-order", check=False)
    assert p.returncode == 2 and "set gptq too" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = vizq("eval", "--gptaq", check=False)
    assert p.returncode == 2 and "gptaq" in p.stderr and "set gptq too" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = vizq("eval", "--gptq-damp", "0.1", check=False)
    assert p.returncode == 2 and "gptq_damp" in p.stderr and "set gptq too" in p.stderr
    p = vizq("eval", "--gptq", "--gptq-damp", "2", check=False)
    assert p.returncode == 2 and "at most 1" in p.stderr and len(p.stderr.strip().splitlines()) == 1
