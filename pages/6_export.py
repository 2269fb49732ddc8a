"""Export: the calibrated configuration and parameters; import a configuration to re-evaluate."""
import io
import tempfile
import zipfile
from pathlib import Path

import pandas as pd
import plotly.express as px
import streamlit as st

from vizq.ptq.config import QuantConfig
from vizq.ptq.deploy import NonUniform, archive, first_difference, prepare
from vizq.ptq.evaluate import calibrate, run_eval
from vizq.ptq.export import export
from vizq.ui import jobs
from vizq.ui.presets import config_form
from vizq.ui.state import chart, current_model, guard

st.title("Export")
lm = current_model()
s = st.session_state
data = s.data_path if s.data_mode == "folder" else None

if s.data_mode == "upload":
    st.warning("Uploaded images are not used for calibration yet: exports calibrate on the model's bundled data. "
               "Choose a folder in the sidebar to calibrate on your own images.")
st.caption("Starts from the configuration of your last evaluation; change it here if you like.")
with guard("Checking the configuration"):
    cfg = config_form("export")

c1, c2 = st.columns(2)
c1.download_button("Configuration (JSON)", cfg.to_json(), file_name="vizq-config.json", mime="application/json", on_click="ignore")
c2.download_button("Configuration (YAML)", cfg.to_yaml(), file_name="vizq-config.yaml", mime="text/yaml", on_click="ignore")

if st.button("Calibrate and build the export", type="primary"):
    with guard("Calibrating"), st.spinner("Calibrating…"):
        cal = calibrate(lm, cfg, data, for_eval=False)
        qm = cal.qmodel
        if cal.skipped:
            st.warning(f"{len(cal.skipped)} calibration file(s) could not be read and were skipped: "
                       + "; ".join(cal.skipped[:5]))
        with tempfile.TemporaryDirectory() as tmp:
            out = export(qm, Path(tmp) / "vizq-export", cal.image_ids, skipped=cal.skipped)
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
                for f in sorted(out.iterdir()):
                    z.write(f, f"vizq-export/{f.name}")
            s.export_zip = buf.getvalue()
            s.export_aimet = (out / "aimet_encodings.json").read_bytes()
            s.export_params = (out / "quant_params.json").read_bytes()
        qm.remove_hooks()
if s.get("export_zip"):
    c1, c2, c3 = st.columns(3)
    c1.download_button("Everything (zip: config, parameters, manifest)", s.export_zip, file_name="vizq-export.zip",
                       mime="application/zip", on_click="ignore")
    c2.download_button("Calibrated parameters (JSON summary)", s.export_params, file_name="quant_params.json",
                       mime="application/json", on_click="ignore")
    c3.download_button("AIMET encodings", s.export_aimet, file_name="aimet_encodings.json", mime="application/json",
                       on_click="ignore")

st.subheader("Deployable: ONNX QDQ, checked in ONNX Runtime")
st.caption("Writes a standard ONNX graph (QuantizeLinear/DequantizeLinear, opset 21) of this configuration and "
           "runs it in ONNX Runtime (CPU) next to vizq's own fake-quantized model on held-out images.")
o1, o2 = st.columns(2)
choice = o1.radio("Sites whose quantizer has no QDQ form (log√2, AdaLog, twin, MX …)",
                  [c.value for c in NonUniform], key="onnx-choice", horizontal=True,
                  format_func=lambda v: {"uniform": "replace by uniform (same bits, recalibrated)",
                                         "float": "keep in float"}[v])
n_check = o2.number_input("Images to check", 0, 50000, 200, step=50, key="onnx-n",
                          help="0: build the graph without running it")
if st.button("Build model.onnx and check it"):
    s.pop("onnx_result", None)
    jobs.start("onnx-job", lambda **kw: prepare(lm, cfg, data, NonUniform(choice), int(n_check), **kw))
jobs.show("onnx-job", lambda dep: s.update(onnx_result={"report": dep.report(), "zip": archive(dep),
                                                        "onnx": dep.graph.model}))
if s.get("onnx_result"):
    rep = s.onnx_result["report"]
    p = rep["parity"]
    if p:
        labels = p["labels"]
        m1, m2, m3, m4 = st.columns(4)
        if labels:
            m1.metric("Research (vizq fake-quant) top-1", f"{p['research_top1']:.2f}%")
            m2.metric("Deployable (ORT, QDQ graph) top-1", f"{p['ort_top1']:.2f}%",
                      delta=f"{p['ort_top1'] - p['research_top1']:+.2f} pts")
        else:
            m1.metric("Research model agrees with FP", "see Evaluate")
            m2.metric("Images (no labels: agreement only)", p["images"])
        m3.metric("ORT agrees with vizq (top-1)", f"{p['agreement']:.2f}%")
        m4.metric("vizq fp32 vs fp64 (noise floor)", f"{p['noise_floor_agreement']:.2f}%")
        st.caption(f"{p['images']} held-out images{'' if labels else ' without labels'}. vizq's deployable model "
                   f"{'top-1 ' + format(p['vizq_top1'], '.2f') + '%' if labels else ''}; max |logit difference| "
                   f"ORT vs vizq {p['max_abs_logit_diff']:.3g}. The noise floor is vizq against itself with float64 "
                   f"arithmetic between the quantizers: a quantized ViT's top-1 can hinge on float rounding, so "
                   f"no runtime can agree beyond it. On the {p['stable_images']} images where vizq's answer does not "
                   f"depend on it, ORT agrees on {p['agreement_stable']:.2f}%.")
        why = first_difference(p["sites"])
        if why:
            st.info(why + ".")
        sites = pd.DataFrame(p["sites"])
        if not sites.empty:
            fig = px.line(sites, x="site", y="changed_pct", markers=True, log_y=bool((sites.changed_pct > 0).any()),
                          labels={"changed_pct": "values on another level (%)", "site": "site (network order)"},
                          title="Where ORT and vizq diverge (first images)")
            fig.update_yaxes(exponentformat="power")
            chart(fig, sites, "onnx-site-divergence")
    if rep["changed_sites"]:
        st.markdown(f"**{len(rep['changed_sites'])} site(s) had to change** (no QDQ form):")
        st.dataframe(pd.DataFrame(rep["changed_sites"]), hide_index=True, width="stretch")
    else:
        st.markdown("Every quantized site has an exact QDQ form; nothing had to change.")
    with st.expander("How each site is written"):
        st.dataframe(pd.DataFrame(rep["sites"]), hide_index=True, width="stretch")
    d1, d2 = st.columns(2)
    d1.download_button("model.onnx", s.onnx_result["onnx"], file_name="model.onnx", mime="application/octet-stream",
                       on_click="ignore")
    d2.download_button("Everything (zip: model.onnx, deploy.json, vizq export)", s.onnx_result["zip"],
                       file_name="vizq-onnx-export.zip", mime="application/zip", on_click="ignore")

st.subheader("Import a configuration and re-evaluate it")
up = st.file_uploader("QuantConfig (.json / .yaml)", type=["json", "yaml", "yml"])
n_eval = st.number_input("Evaluation images", 10, 50000, 500, step=50, key="import-n")
if up is not None:
    with guard(f"Reading {up.name}"):
        imported = QuantConfig.from_text(up.getvalue().decode("utf-8", errors="replace"))
    st.code(imported.to_yaml(), language="yaml")
    if st.button("Evaluate this configuration"):
        jobs.start("import-job", lambda **kw: run_eval(lm, imported, data, int(n_eval), **kw)[0])
jobs.show("import-job", lambda res: s.update(import_result=res.to_dict()))
if s.get("import_result"):
    r = s.import_result
    extra = ", ".join(f"{k} {v:.3f}" for k, v in r.get("metrics", {}).items())
    st.success(f"{r['method']} W{r['wbits']}A{r['abits']}: top-1 {r['q_top1']}, agreement {r['agreement']:.2f}%"
               + (f", KL {r['kl']:.4f}" if r.get("kl") is not None else "") + (f", {extra}" if extra else ""))
