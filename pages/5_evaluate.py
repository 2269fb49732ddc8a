"""Evaluate: calibrate a preset or a custom mix, run it against full precision, keep history."""
import pandas as pd
import streamlit as st

from vizq import plots
from vizq.ptq.evaluate import run_eval, sensitivity
from vizq.runs import append_run, clear_history, load_history
from vizq.ui import jobs
from vizq.ui.presets import config_form
from vizq.ui.state import chart, chart_table, current_model, guard

st.title("Evaluate")
lm = current_model()
s = st.session_state
data = s.data_path if s.data_mode == "folder" else None
if lm.info.modality == "text":
    st.info("Sentence encoder: evaluation compares quantized with full-precision embeddings (mean cosine) and "
            "nearest-neighbour retrieval among the evaluated sentences (top-1 agreement, recall@10).")
elif s.data_mode == "upload":
    st.warning("Uploaded images are not used for evaluation yet: runs on this page calibrate and evaluate on the "
               "model's bundled data. Choose a folder in the sidebar to evaluate your own images.")

with guard("Checking the configuration"):
    cfg = config_form("eval")
n_eval = st.number_input("Evaluation images (disjoint from calibration)", 10, 50000, 500, step=50)


def evaluate_and_record(lm, cfg, data, n_eval, progress=None, cancel=None):
    res, _ = run_eval(lm, cfg, data, n_eval, progress=progress, cancel=cancel)
    rec = res.to_dict()
    rec.pop("site_sqnr_db")
    return append_run(rec), res


def summary(rec):
    parts = [f"calibrated on {rec['calib_images']}, evaluated on {rec['eval_images']} images"]
    if rec.get("q_top1") is not None:
        parts.append(f"top-1 {rec['q_top1']:.2f}% (FP {rec['fp_top1']:.2f}%)")
    elif lm.info.modality == "image":
        parts.append("no labels in these images, so no top-1: agreement with full precision and KL only")
    parts.append(f"agreement {rec['agreement']:.2f}%")
    if rec.get("kl") is not None:
        parts.append(f"KL {rec['kl']:.4f}")
    parts += [f"{k} {v:.3f}" for k, v in rec.get("metrics", {}).items()]
    return ", ".join(parts)


def on_done(out):
    rec, res = out
    s.last_config = cfg
    s.eval_message = f"{rec['method']} W{rec['wbits']}A{rec['abits']}: " + summary(rec)
    s.last_sqnr = res.site_sqnr_db


c1, c2 = st.columns(2)
if c1.button("Run evaluation", type="primary"):
    s.last_config = cfg
    jobs.start("eval-job", evaluate_and_record, lm, cfg, data, int(n_eval))
jobs.show("eval-job", on_done)
if s.get("eval_message"):
    st.success(s.eval_message)

if s.get("last_sqnr"):
    with st.expander("Per-site output SQNR of the last run (dB)"):
        chart_table(pd.DataFrame(sorted(s.last_sqnr.items(), key=lambda kv: kv[1]), columns=["site", "sqnr_db"]), "site-sqnr")

hist = [r for r in load_history() if r.get("model") == lm.info.model_id]
st.subheader(f"History for {lm.info.model_id} ({len(hist)} runs, kept on disk)")
if hist:
    metric = st.radio("Metric", ["q_top1", "agreement", "kl"], horizontal=True)
    chart(*plots.accuracy_vs_bits(hist, metric), "history-chart")
    cols = ["time", "method", "wbits", "abits", "calib_images", "eval_images", "fp_top1", "q_top1", "agreement", "kl",
            "seconds_calibrate", "seconds_eval"]
    table = pd.DataFrame(hist)
    extra = pd.json_normalize(table.pop("metrics")) if "metrics" in table else pd.DataFrame()
    chart_table(pd.concat([table[[c for c in cols if c in table]], extra], axis=1), "history")
    if c2.button("Clear history"):
        clear_history()
        st.rerun()

st.subheader("Sensitivity")
c1, c2, c3 = st.columns(3)
by = c1.radio("Quantize", ["kind", "block"], horizontal=True, format_func={"kind": "one site kind", "block": "one block"}.get)
mode = c2.radio("Mode", ["only", "all_but"], horizontal=True, format_func={"only": "only it", "all_but": "all but it"}.get)
if c3.button("Rank sensitivity"):
    jobs.start("sens-job", sensitivity, lm, cfg, data, 200, by, mode)
jobs.show("sens-job", lambda rows: s.update(sens_rows=rows))
if s.get("sens_rows"):
    chart_table(pd.DataFrame(s.sens_rows), "sensitivity")
