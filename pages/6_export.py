"""Export: the calibrated configuration and parameters; reload an export or a configuration."""
import tempfile
from pathlib import Path

import pandas as pd
import plotly.express as px
import streamlit as st

from vizq.ptq import service
from vizq.ptq.config import QuantConfig
from vizq.ptq.deploy import NonUniform, archive, first_difference
from vizq.ui import jobs
from vizq.ui.presets import config_form
from vizq.ui.state import chart, current_data, current_model, guard, kept, units

st.title("Export")
lm = current_model()
s = st.session_state
data = current_data()
st.markdown(f"**Calibration data:** {data.label(lm)}. The configuration below is the one on *Evaluate* "
            "(one form, shared by both pages).")
with guard("Checking the configuration"):
    cfg = config_form(lm.info.modality)

c1, c2 = st.columns(2)
c1.download_button("Configuration (JSON)", cfg.to_json(), file_name="vizq-config.json", mime="application/json", on_click="ignore")
c2.download_button("Configuration (YAML)", cfg.to_yaml(), file_name="vizq-config.yaml", mime="text/yaml", on_click="ignore")

if st.button("Calibrate and build the export", type="primary"):
    jobs.start("export-job", service.export_zip, lm, cfg, data, clears=("export_archive",))
jobs.show("export-job", lambda arc: s.update(export_archive=arc))
if s.get("export_archive"):
    arc = s.export_archive
    st.success(f"Calibrated on {arc.calib_images} {units(lm)} "
               f"of {data.label(lm)}. The zip reloads as it is (below, or `python -m vizq eval --model {lm.info.model_id} --config ZIP`).")
    if arc.skipped:
        st.warning(f"{len(arc.skipped)} calibration file(s) could not be read and were skipped: " + "; ".join(arc.skipped[:5]))
    c1, c2, c3 = st.columns(3)
    c1.download_button("Everything (zip: config, parameters, manifest)", arc.zip, file_name="vizq-export.zip",
                       mime="application/zip", on_click="ignore")
    c2.download_button("Calibrated parameters (JSON summary)", arc.params_json, file_name="quant_params.json",
                       mime="application/json", on_click="ignore")
    c3.download_button("AIMET encodings", arc.aimet_json, file_name="aimet_encodings.json", mime="application/json",
                       on_click="ignore")

st.subheader("Deployable: ONNX QDQ, checked in ONNX Runtime")
if lm.info.modality != "image":
    st.info("ONNX QDQ export covers image models. A text encoder deploys from the export above: its zip "
            f"reloads bit-exactly in vizq (`python -m vizq eval --model {lm.info.model_id} --config ZIP`).")
else:
    st.caption("Writes a standard ONNX graph (QuantizeLinear/DequantizeLinear, opset 21) of this configuration and "
               "runs it in ONNX Runtime (CPU) next to vizq's own fake-quantized model on held-out images.")
    o1, o2 = st.columns(2)
    choice = kept(o1.radio, "Sites whose quantizer has no QDQ form (log√2, AdaLog, twin, MX …)",
                      "onnx-choice", NonUniform.FLOAT.value, options=[c.value for c in NonUniform], horizontal=True,
                      format_func=lambda v: {"uniform": "replace by uniform (same bits, recalibrated)",
                                             "float": "keep in float"}[v])
    n_check = kept(o2.number_input, "Images to check", "onnx-n", 200, min_value=0, max_value=50000, step=50,
                   help="0: build the graph without running it")
    if st.button("Build model.onnx and check it"):
        jobs.start("onnx-job", service.deploy, lm, cfg, data, NonUniform(choice), int(n_check), clears=("onnx_result",))
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

st.subheader("Reload an export, or import a configuration, and evaluate it")
st.caption(f"An export zip (or folder's files zipped) is reloaded bit-exactly, without recalibrating; a configuration "
           f"(.json/.yaml) is calibrated afresh. Either is evaluated on {data.label(lm)}.")
up = st.file_uploader("vizq export (.zip) or QuantConfig (.json / .yaml)", type=["zip", "json", "yaml", "yml"])
n_eval = kept(st.number_input, f"Evaluation {units(lm)}", "import-n", 500, min_value=1, max_value=50000, step=50)


def evaluate_export(lm, blob, data, n_eval, run):
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "export.zip"
        p.write_bytes(blob)
        with service.reload(lm, p) as qm:
            return service.evaluate(lm, qm.config, data, n_eval, run, qmodel=qm)


if up is not None:
    if up.name.lower().endswith(".zip"):
        if st.button("Reload this export and evaluate it"):
            jobs.start("import-job", evaluate_export, lm, up.getvalue(), data, int(n_eval), clears=("import_result",))
    else:
        with guard(f"Reading {up.name}"):
            imported = QuantConfig.from_text(up.getvalue().decode("utf-8", errors="replace"))
        st.code(imported.to_yaml(), language="yaml")
        if st.button("Calibrate and evaluate this configuration"):
            jobs.start("import-job", service.evaluate, lm, imported, data, int(n_eval), clears=("import_result",))
jobs.show("import-job", lambda res: s.update(import_result=res.to_dict()))
if s.get("import_result"):
    r = s.import_result
    extra = ", ".join(f"{k} {v:.3f}" for k, v in r.get("metrics", {}).items())
    top1 = f"top-1 {r['q_top1']:.2f}%" if r.get("q_top1") is not None else "no labels (agreement only)"
    origin = "reloaded export" if not r["calib_images"] else f"calibrated on {r['calib_images']}"
    st.success(f"{r['preset']} W{r['wbits']}A{r['abits']} ({origin}), evaluated on {r['eval_images']}: {top1}, "
               f"agreement {r['agreement']:.2f}%" + (f", KL {r['kl']:.4f}" if r.get("kl") is not None else "")
               + (f", {extra}" if extra else ""))
