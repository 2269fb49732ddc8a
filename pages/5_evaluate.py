"""Evaluate: calibrate a preset or a custom mix, run it against full precision, keep history."""
import pandas as pd
import streamlit as st

from vizq import plots
from vizq.ptq import service
from vizq.ptq.config import options_label
from vizq.runs import append_run, clear_history, load_history
from vizq.ui import jobs
from vizq.ui.presets import config_form
from vizq.ui.state import chart, chart_table, current_data, current_model, guard, kept, units

st.title("Evaluate")
lm = current_model()
s = st.session_state
data = current_data()
unit = units(lm)


def count(n, what=unit):
    return f"{n} {what[:-1] if n == 1 else what}"


st.markdown(f"**Data:** {data.label(lm)} — calibration and evaluation both come from it, disjoint.")
if lm.info.modality == "text":
    st.info("Sentence encoder: evaluation compares quantized with full-precision embeddings (mean cosine) and "
            "nearest-neighbour retrieval among the evaluated sentences (top-1 agreement, recall@10).")

with guard("Checking the configuration"):
    cfg = config_form(lm.info.modality)
n_eval = kept(st.number_input, f"Evaluation {unit} (disjoint from calibration)", "eval-n", 500, min_value=1,
              max_value=50000, step=50)
with guard("Reading the data"):
    will = service.counts(lm, cfg, data, int(n_eval))
st.caption(f"This run will calibrate on {count(will.calib)} of the training split and evaluate on {will.eval} of "
           f"the {will.pool} held-out ones." if will.own_split else
           f"This run will calibrate on {count(will.calib)} and evaluate on {count(will.eval)}: the data holds "
           f"{will.pool}, and calibration never takes more than half of a pool it shares with evaluation.")


def evaluate_and_record(lm, cfg, data, n_eval, run):
    res = service.evaluate(lm, cfg, data, n_eval, run)
    rec = res.to_dict(per_site=False)
    return append_run(rec), res


def summary(rec):
    parts = [f"calibrated on {count(rec['calib_images'])}, evaluated on {count(rec['eval_images'])} ({data.label(lm)})"]
    if rec.get("q_top1") is not None:
        parts.append(f"top-1 {rec['q_top1']:.2f}% (FP {rec['fp_top1']:.2f}%)")
    elif lm.info.modality == "image":
        parts.append("no labels in these images, so no top-1: agreement with full precision and KL only")
    parts.append(f"agreement {rec['agreement']:.2f}%")
    if rec.get("kl") is not None:
        parts.append(f"KL {rec['kl']:.4f}")
    parts += [f"{k} {v:.3f}" for k, v in rec.get("metrics", {}).items()]
    if rec.get("skipped_images"):
        parts.append(f"{rec['skipped_images']} unreadable file(s) skipped")
    return ", ".join(parts)


def sqnr_table(site, own):
    """Both SQNRs of each site, worst against FP first (residual sites have no quantizer: empty)."""
    names = sorted(site, key=site.get)
    return pd.DataFrame({"site": names, "sqnr_vs_fp_db": [site[n] for n in names],
                         "own_quantizer_sqnr_db": [own.get(n) for n in names]})


def on_done(out):
    rec, res = out
    opts = options_label(rec.get("config"))
    s.eval_message = f"{rec['preset']} W{rec['wbits']}A{rec['abits']}{' ' + opts if opts else ''}: " + summary(rec)
    s.last_sqnr = (res.site_sqnr_db, res.quantizer_sqnr_db)


c1, c2 = st.columns(2)
if c1.button("Run evaluation", type="primary"):
    jobs.start("eval-job", evaluate_and_record, lm, cfg, data, int(n_eval), clears=("eval_message", "last_sqnr"))
jobs.show("eval-job", on_done)
if s.get("eval_message"):
    st.success(s.eval_message)

if s.get("last_sqnr"):
    with st.expander("Per-site SQNR of the last run (dB)"):
        st.caption("**against FP**: the quantized model's tensor at the site against the full-precision model's, so "
                   "it carries every error made upstream (late sites read low even when their own quantizer is "
                   "fine). **own quantizer**: the site's quantizer output against the tensor it was handed, its "
                   "rounding alone (empty for sites that are observed, not quantized). A site low in the first "
                   "column and high in the second is drift, not a coarse quantizer.")
        chart_table(sqnr_table(*s.last_sqnr), "site-sqnr")

key = data.key()
hist = [r for r in load_history() if r.get("model") == lm.info.model_id
        and (r.get("data") or {}).get("key", "not recorded") == key]
st.subheader(f"History for {lm.info.model_id} on this data ({count(len(hist), 'runs')}, kept on disk)")
st.caption("Only runs on the data shown above; runs on other data are kept but never drawn on the same line.")
if hist:
    # only the metrics these runs have: label-free data has no top-1 to choose
    metrics = [m for m in ("q_top1", "agreement", "kl") if any(r.get(m) is not None for r in hist)]
    metric = st.radio("Metric", metrics, horizontal=True, format_func={
        "q_top1": "top-1 (%)", "agreement": "agreement with FP (%)", "kl": "KL(FP‖Q)"}.get)
    chart(*plots.accuracy_vs_bits(hist, metric), "history-chart")
    cols = ["time", "preset", "wbits", "abits", "calib_images", "eval_images", "fp_top1", "q_top1", "agreement", "kl",
            "seconds_calibrate", "seconds_eval"]
    table = pd.DataFrame(hist)
    table.insert(2, "options", [options_label(r.get("config")) or "—" for r in hist])
    cols.insert(2, "options")
    extra = pd.json_normalize(table.pop("metrics")) if "metrics" in table else pd.DataFrame()
    chart_table(pd.concat([table[[c for c in cols if c in table]], extra], axis=1), "history")
    if c2.button("Clear history"):
        clear_history()
        st.rerun()

st.subheader("Sensitivity")
c1, c2, c3 = st.columns(3)
by = c1.radio("Quantize", list(service.By), horizontal=True,
              format_func={service.By.KIND: "one site kind", service.By.BLOCK: "one block"}.get)
mode = c2.radio("Mode", list(service.Mode), horizontal=True,
                format_func={service.Mode.ONLY: "only it", service.Mode.ALL_BUT: "all but it"}.get)
if c3.button("Rank sensitivity"):
    jobs.start("sens-job", service.sensitivity, lm, cfg, data, 200, by, mode, clears=("sens_rows",))
jobs.show("sens-job", lambda rows: s.update(sens_rows=rows))
if s.get("sens_rows"):
    chart_table(pd.DataFrame(s.sens_rows), "sensitivity")
