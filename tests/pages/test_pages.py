"""Every dashboard page on the bundled model, through Streamlit's AppTest (no browser)."""
from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[2]
PAGES = {
    "pages/1_model_data.py": 0,
    "pages/2_softmax.py": 4,  # log2 histogram, CCDF, overlay, sinks
    "pages/3_layernorm.py": 3,  # variation heatmap, channel ranges, reparam preview
    "pages/4_lab.py": 2,  # levels over histogram, error scatter
    "pages/5_evaluate.py": 0,
    "pages/6_export.py": 0,
}


@pytest.fixture()
def app(tmp_path, monkeypatch):
    monkeypatch.setenv("VIZQ_HOME", str(tmp_path))
    monkeypatch.setenv("VIZQ_DASHBOARD_MODEL", "vizq-vit-tiny")  # the fast fixture; the real default has its own test
    monkeypatch.chdir(ROOT)
    st.cache_resource.clear()
    st.cache_data.clear()
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception
    yield at
    st.cache_resource.clear()


def _goto(at: AppTest, page: str) -> AppTest:
    at.switch_page(page)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


@pytest.mark.parametrize("page", list(PAGES))
def test_page_renders_with_its_charts(app, page):
    at = _goto(app, page)
    assert len(at.get("plotly_chart")) >= PAGES[page]
    if PAGES[page]:
        assert len(at.get("download_button")) >= PAGES[page]  # every chart's data downloadable


def test_model_page_shows_summary(app):
    at = _goto(app, "pages/1_model_data.py")
    labels = {m.label: m.value for m in at.metric}
    assert labels["blocks"] == "6" and labels["weights"] == "bundled"
    assert any("Captured" in s.value for s in at.success)


def test_lab_rerenders_when_bits_or_quantizers_change(app):
    at = _goto(app, "pages/4_lab.py")
    first = at.dataframe[0].value.copy()
    at.slider[0].set_value(6).run()
    assert not at.exception
    second = at.dataframe[0].value
    assert (second["bits"] == 6).any() and not first["mse"].equals(second["mse"])
    at.multiselect[0].set_value(["uniform", "fp4_e2m1"]).run()
    assert not at.exception
    assert len(at.dataframe[0].value) == 2
    assert any("updated in" in c.value for c in at.caption)


def test_bad_folder_is_a_message_not_a_traceback(app):
    at = app
    at.session_state["data_mode"] = "folder"
    at.session_state["data_path"] = "/no/such/folder"
    at = _goto_allow_error(at, "pages/2_softmax.py")
    assert any("does not exist" in e.value for e in at.error)
    assert not at.exception


def _goto_allow_error(at: AppTest, page: str) -> AppTest:
    at.switch_page(page)
    at.run()
    return at


def test_evaluation_runs_in_background_and_lands_in_history(app):
    at = _goto(app, "pages/5_evaluate.py")
    at.number_input[-1].set_value(100)
    next(b for b in at.button if b.label == "Run evaluation").click().run()
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(1)
        at.run()
        if any("agreement" in s.value for s in at.success):
            break
    assert any("agreement" in s.value for s in at.success), [e.value for e in at.error]
    assert len(at.get("plotly_chart")) >= 1  # accuracy against bits
    from vizq.runs import load_history

    assert load_history()[-1]["method"] == "repq" and load_history()[-1]["eval_images"] == 100


def test_export_download_loads_back_bit_exactly(app, tmp_path):
    import torch

    from vizq.models import load_model
    from vizq.ptq.config import QuantConfig
    from vizq.ptq.engine import QuantizedModel
    from vizq.ptq.evaluate import calibration_batch
    from vizq.ptq.export import load_export

    at = _goto(app, "pages/6_export.py")
    next(b for b in at.button if b.label.startswith("Calibrate")).click().run()
    assert not at.exception
    data = at.session_state["export_zip"]
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    lm = load_model("vizq-vit-tiny")
    back = load_export(tmp_path / "vizq-export", lm)
    cfg = QuantConfig.load(tmp_path / "vizq-export")
    calib, _ = calibration_batch(lm, cfg)
    fresh = QuantizedModel(lm, cfg).calibrate(calib)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(back(x), fresh(x))


def test_every_page_accepts_the_text_model(app):
    at = app
    at.session_state["model_mode"] = "text"
    at.session_state["model_spec"] = "minilm-l6"
    at.session_state["n_images"] = 16
    for page in PAGES:
        at.switch_page(page)
        at.run()
        assert not at.exception, (page, [e.value for e in at.exception])
        assert not at.error, (page, [e.value for e in at.error])
    at.switch_page("pages/2_softmax.py")
    at.run()
    assert any("reads text" in i.value for i in at.info)  # the image overlay says why it is hidden
    assert len(at.get("plotly_chart")) >= 3


def test_export_page_builds_onnx_and_shows_research_vs_deployable(app, tmp_path):
    from vizq.models import load_model
    from vizq.ptq.deploy import load

    at = _goto(app, "pages/6_export.py")
    at.number_input(key="onnx-n").set_value(40)
    next(b for b in at.button if b.label.startswith("Build model.onnx")).click().run()
    deadline = time.time() + 120
    while time.time() < deadline and "onnx_result" not in at.session_state:
        time.sleep(1)
        at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    labels = {m.label: m.value for m in at.metric}
    assert labels["ORT agrees with vizq (top-1)"].endswith("%")
    assert "Research (vizq fake-quant) top-1" in labels and "Deployable (ORT, QDQ graph) top-1" in labels
    assert any("site(s) had to change" in m.value for m in at.markdown)  # the default repq has log√2 softmax
    zipfile.ZipFile(io.BytesIO(at.session_state["onnx_result"]["zip"])).extractall(tmp_path)
    dep = load(tmp_path / "vizq-onnx-export", load_model("vizq-vit-tiny"))
    assert dep.parity["images"] == 40 and dep.graph.model == at.session_state["onnx_result"]["onnx"]


def test_dashboard_opens_on_the_real_vit_and_shows_its_massive_activations(monkeypatch):
    """No VIZQ_DASHBOARD_MODEL: the first screen is the bundled real ViT-Ti on scikit-image's
    photographs, and the massive-activation view finds what real ViTs have."""
    monkeypatch.delenv("VIZQ_DASHBOARD_MODEL", raising=False)
    monkeypatch.chdir(ROOT)
    st.cache_resource.clear()
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
    at.run()
    assert not at.exception
    labels = {m.label: m.value for m in at.metric}
    assert labels["blocks"] == "12" and labels["weights"].startswith("bundled") and labels["input"] == "3×224×224"
    assert any("scikit-image photographs" in m.value for m in at.sidebar.markdown)
    at = _goto(at, "pages/7_massive.py")
    found = {m.label: m.value for m in at.metric}
    assert not found["sites with massive values"].startswith("0 ")
    assert float(found["largest |x| / median"].rstrip("×").replace(",", "")) >= 1000
    assert len(at.get("plotly_chart")) >= 3  # sites, locations, range study
    st.cache_resource.clear()
