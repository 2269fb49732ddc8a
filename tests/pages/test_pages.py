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


@pytest.fixture(scope="module", autouse=True)
def _caches_of_this_module():
    """Loaded models and captures are shared by the tests here as by the sessions of one server
    (they are never mutated; keys name model, data, count and seed): each test opens a new
    session, and only the first pays for loading and capturing."""
    st.cache_resource.clear()
    st.cache_data.clear()
    yield
    st.cache_resource.clear()


@pytest.fixture()
def app(tmp_path, monkeypatch):
    monkeypatch.setenv("VIZQ_HOME", str(tmp_path))
    monkeypatch.setenv("VIZQ_DASHBOARD_MODEL", "vizq-vit-tiny")  # the fast fixture; the real default has its own test
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception
    return at


def _fresh(**state) -> AppTest:
    """A new session whose first run (through the router, sidebar included) starts from ``state``
    (AppTest draws the sidebar on a session's first run only; later runs execute the page alone)."""
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    return at


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
    table = at.dataframe[0].value
    assert len(table) == 2
    assert list(table.compared_at) == ["slider width", "own width (4 bits)"]  # never ranked against the 6-bit grid
    assert any("run at their own width (4 bits), not at the slider's 6" in c.value for c in at.caption)
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

    assert load_history()[-1]["preset"] == "repq" and load_history()[-1]["eval_images"] == 100


def test_gptq_and_reconstruction_are_choices_on_evaluate_and_history_says_they_were_used(app):
    at = _goto(app, "pages/5_evaluate.py")
    assert at.checkbox(key="cfg-rscales").disabled  # nothing to learn scales in until steps are set
    assert at.selectbox(key="cfg-rloss").disabled  # nor a loss to choose
    assert at.number_input(key="cfg-rviews").disabled  # nor views to train on
    assert at.number_input(key="cfg-rranges").disabled  # nor images kept for it alone
    assert not at.checkbox(key="cfg-gptq").disabled  # repq, the default preset: an integer grid
    at.number_input(key="cfg-calib").set_value(4).run()  # what is checked is the record, not the accuracy
    assert at.checkbox(key="cfg-gptq-order").disabled  # act order orders GPTQ's rounding: off without it
    assert at.checkbox(key="cfg-gptaq").disabled  # so does GPTAQ's target
    assert at.number_input(key="cfg-gptq-damp").disabled  # and GPTQ's damping
    at.checkbox(key="cfg-gptq").check().run()
    at.checkbox(key="cfg-gptq-order").check().run()
    at.checkbox(key="cfg-gptaq").check().run()
    at.number_input(key="cfg-gptq-damp").set_value(0.1).run()
    at.number_input(key="cfg-recon").set_value(20).run()
    at.checkbox(key="cfg-rscales").check().run()
    at.selectbox(key="cfg-rloss").set_value("token").run()
    at.number_input(key="cfg-rviews").set_value(2).run()
    at.number_input(key="cfg-rranges").set_value(2).run()
    at.number_input[-1].set_value(20)
    next(b for b in at.button if b.label == "Run evaluation").click().run()
    _wait(at, lambda a: any("agreement" in s.value for s in a.success))
    msg = next(s.value for s in at.success if "agreement" in s.value)
    assert "+gptaq act order damp 0.1 · +recon 20 · LSQ · ranges on 2 · 2 views · token loss" in msg, msg
    from vizq.runs import load_history

    cfg = load_history()[-1]["config"]
    assert cfg["recon_iters"] == 20 and cfg["recon_scales"] is True and cfg["recon_batch"] == 0 and cfg["gptq"] is True
    assert cfg["recon_loss"] == "token" and cfg["recon_views"] == 2 and cfg["range_images"] == 2
    assert cfg["gptq_act_order"] is True and cfg["gptaq"] is True and cfg["gptq_damp"] == 0.1
    table = next(df.value for df in at.dataframe if "options" in df.value.columns)
    assert list(table["options"]) == ["+gptaq act order damp 0.1 · +recon 20 · LSQ · ranges on 2 · 2 views · token loss"]


def test_ias_released_offers_its_steps_not_a_second_reconstruction(app):
    """The faithful I&S-ViT preset: its cost is stated, its own steps are a choice, the optional
    block reconstruction (which would add a third training) is disabled, and the run records
    the steps it used."""
    at = _goto(app, "pages/5_evaluate.py")
    at.selectbox(key="cfg-method").set_value("ias-released").run()
    assert any("1,000 Adam steps" in w.value for w in at.warning)
    assert at.number_input(key="cfg-recon").disabled
    at.number_input(key="cfg-ias").set_value(2).run()
    at.number_input(key="cfg-calib").set_value(4).run()
    at.number_input[-1].set_value(20)
    next(b for b in at.button if b.label == "Run evaluation").click().run()
    _wait(at, lambda a: any("agreement" in s.value for s in a.success) or bool(a.error))
    assert not at.error, [e.value for e in at.error]
    msg = next(s.value for s in at.success if "agreement" in s.value)
    assert "2 steps a block" in msg, msg
    from vizq.runs import load_history

    cfg = load_history()[-1]["config"]
    assert cfg["preset"] == "ias-released" and cfg["ias_iters"] == 2 and cfg["recon_iters"] == 0


def _wait(at: AppTest, done, timeout: float = 120) -> AppTest:
    deadline = time.time() + timeout
    while time.time() < deadline and not done(at):
        time.sleep(1)
        at.run()
    return at


def test_export_zip_reloads_as_it_is_bit_exactly(app, tmp_path):
    import torch

    from vizq.models import load_model
    from vizq.ptq.config import QuantConfig
    from vizq.ptq.engine import QuantizedModel
    from vizq.ptq.evaluate import calibration_batch
    from vizq.ptq.export import load_export

    at = _goto(app, "pages/6_export.py")
    next(b for b in at.button if b.label.startswith("Calibrate")).click().run()
    at = _wait(at, lambda at: "export_archive" in at.session_state)
    assert not at.exception and not at.error, [e.value for e in at.error]
    zpath = tmp_path / "vizq-export.zip"
    zpath.write_bytes(at.session_state["export_archive"].zip)  # as the browser downloads it
    lm = load_model("vizq-vit-tiny")
    back = load_export(zpath, lm)  # the zip itself, not unpacked by hand
    zipfile.ZipFile(zpath).extractall(tmp_path)
    cfg = QuantConfig.load(tmp_path / "vizq-export")
    calib, _ = calibration_batch(lm, cfg, for_eval=False)
    with QuantizedModel(lm, cfg) as fresh:
        fresh.calibrate(calib)
        x = torch.randn(4, 3, 32, 32)
        with torch.no_grad():
            assert torch.equal(back(x), fresh(x))
    man = __import__("json").loads((tmp_path / "vizq-export" / "manifest.json").read_text())
    assert man["data"]["source"] == "bundled" and len(man["calibration_image_ids"]) == 32


def test_uploads_are_the_data_evaluate_uses_and_history_records_it(app):
    """Symptom 1: with three uploaded photographs, Evaluate calibrates and evaluates on them
    (1 + 2, disjoint), says so, and the history record names the upload."""
    import numpy as np
    from PIL import Image

    from vizq.runs import load_history

    files = []
    for i in range(3):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buf, "PNG")
        files.append((f"p{i}.png", buf.getvalue()))
    at = _fresh(data_mode="upload", uploads=files)
    assert any("3 uploaded file(s)" in m.value for m in at.sidebar.markdown)
    at = _goto(at, "pages/5_evaluate.py")
    assert any("3 uploaded file(s)" in m.value for m in at.markdown)  # what the page says it uses
    assert any("calibrate on 1 image and evaluate on 2 images: the data holds 3" in c.value for c in at.caption)
    next(b for b in at.button if b.label == "Run evaluation").click().run()
    at = _wait(at, lambda at: any("agreement" in s.value for s in at.success))
    text = next(s.value for s in at.success if "agreement" in s.value)
    assert "calibrated on 1 image, evaluated on 2 images (3 uploaded file(s))" in text and "no labels" in text, text
    rec = load_history()[-1]
    assert rec["data"]["source"] == "upload" and rec["data"]["files"] == ["p0.png", "p1.png", "p2.png"]
    assert rec["calib_images"] == 1 and rec["eval_images"] == 2


def test_settings_survive_leaving_the_page_and_are_shared_with_export(app):
    at = _goto(app, "pages/5_evaluate.py")
    at.selectbox(key="cfg-method").set_value("minmax").run()
    at.selectbox(key="cfg-w").set_value(8).run()
    at.number_input(key="eval-n").set_value(120).run()
    at = _goto(at, "pages/2_softmax.py")
    at = _goto(at, "pages/5_evaluate.py")
    assert at.selectbox(key="cfg-method").value == "minmax" and at.selectbox(key="cfg-w").value == 8
    assert at.number_input(key="eval-n").value == 120
    at = _goto(at, "pages/6_export.py")  # Export shows the configuration chosen on Evaluate
    assert at.selectbox(key="cfg-method").value == "minmax" and at.selectbox(key="cfg-w").value == 8


def test_a_cancel_removes_the_previous_runs_message(app):
    """Symptom 3: after a finished run, a new run that is cancelled shows "Cancelled", not the
    old run's success box. The Cancel press is simulated from another thread while the page
    polls (AppTest blocks in the page's polling loop, as a browser session would)."""
    import gc
    import threading

    from vizq.jobs import Job

    at = _goto(app, "pages/5_evaluate.py")
    at.number_input(key="eval-n").set_value(50).run()
    next(b for b in at.button if b.label == "Run evaluation").click().run()
    at = _wait(at, lambda at: any("agreement" in s.value for s in at.success))
    assert any("agreement" in s.value for s in at.success)
    at.number_input(key="eval-n").set_value(400).run()

    def press_cancel() -> None:
        for o in gc.get_objects():
            if type(o) is Job and not o.finished:
                o.cancel()

    timer = threading.Timer(1.5, press_cancel)
    timer.start()
    next(b for b in at.button if b.label == "Run evaluation").click().run()
    timer.join()
    at = _wait(at, lambda at: any("Cancelled" in w.value for w in at.warning))
    assert any("Cancelled" in w.value for w in at.warning)
    assert not any("agreement" in s.value for s in at.success)  # the old result is gone with the new run


def test_text_model_pages_speak_of_sentences(app):
    at = _fresh(model_mode="text", model_spec="minilm-l6", n_images=16)
    labels = {m.label: m.value for m in at.metric}
    assert "patch grid" not in labels and "0×0×0" not in labels.values()
    assert labels["input"].startswith("token ids")
    assert any("16 sentences" in s.value for s in at.success)
    assert any("minilm-l6" in m.value for m in at.sidebar.markdown)
    assert any("bundled sentences" in m.value for m in at.sidebar.markdown)
    assert any("up to 16 sentences" in m.value for m in at.sidebar.markdown)


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


def test_text_model_is_offered_only_what_applies_to_it(app):
    at = _goto(app, "pages/5_evaluate.py")
    at.selectbox(key="cfg-method").set_value("ptq4vit").run()  # chosen for the image model
    at.session_state["model_mode"] = "text"
    at.session_state["model_spec"] = "minilm-l6"
    at.session_state["n_images"] = 16
    at = _goto(at, "pages/6_export.py")
    box = at.selectbox(key="cfg-method")
    from vizq.ptq.presets import PRESETS, presets_for

    offered = [o.split(" ")[0] for o in box.options]  # shown as "name (paper)"
    assert offered == presets_for("text") and "ptq4vit" in PRESETS and "ptq4vit" not in offered
    assert box.value == "repq"
    assert at.number_input(key="cfg-calib").label == "Calibration sentences"
    assert any("ONNX QDQ export covers image models" in i.value for i in at.info)
    assert not any(b.label.startswith("Build model.onnx") for b in at.button)


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
    st.cache_resource.clear()  # the real ViT's 20 MB of weights and its captures are not needed after this
