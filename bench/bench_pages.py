"""Dashboard re-render time per control on the default (real ViT-Ti, bundled photographs).

Each line is one Streamlit script run through AppTest after changing one control, so it is the
server-side cost of the interaction (the browser's drawing comes on top). Target: <= 1000 ms.
Run: PYTHONPATH=. .venv/bin/python bench/bench_pages.py
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    os.environ.pop("VIZQ_DASHBOARD_MODEL", None)  # the real default
    os.environ["VIZQ_HOME"] = tempfile.mkdtemp(prefix="vizq-bench-")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=900)
    t0 = time.perf_counter()
    at.run()
    print(f"{'first screen (load model, capture 32 images)':<44} {1000 * (time.perf_counter() - t0):8.0f} ms")
    rows = []

    def step(label: str, fn) -> None:
        t = time.perf_counter()
        fn()
        ms = 1000 * (time.perf_counter() - t)
        assert not at.exception, [e.value for e in at.exception]
        rows.append(ms)
        print(f"{label:<44} {ms:8.0f} ms {'ok' if ms <= 1000 else 'over 1 s'}")

    at.switch_page("pages/2_softmax.py")
    step("softmax: open", at.run)
    step("softmax: another layer", lambda: at.selectbox[0].set_value(at.selectbox[0].options[5]).run())
    step("softmax: heads", lambda: at.multiselect[0].set_value([0, 1]).run())
    step("softmax: query token", lambda: at.slider[0].set_value(5).run())
    at.switch_page("pages/3_layernorm.py")
    step("layernorm: open", at.run)
    step("layernorm: another site", lambda: at.selectbox[0].set_value(at.selectbox[0].options[3]).run())
    at.switch_page("pages/4_lab.py")
    step("lab: open (6 quantizers, 4 bits, softmax)", at.run)
    step("lab: bits 4 -> 6", lambda: at.slider[0].set_value(6).run())
    step("lab: two quantizers", lambda: at.multiselect[0].set_value(["uniform", "log2"]).run())
    print(f"worst control: {max(rows):.0f} ms (target <= 1000 ms)")


if __name__ == "__main__":
    main()
