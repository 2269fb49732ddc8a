"""Export: the calibrated configuration and parameters; import a configuration to re-evaluate."""
import io
import tempfile
import zipfile
from pathlib import Path

import streamlit as st

from vizq.ptq.config import QuantConfig
from vizq.ptq.evaluate import calibrate, run_eval
from vizq.ptq.export import export
from vizq.ui import jobs
from vizq.ui.presets import config_form
from vizq.ui.state import current_model, guard

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
        cal = calibrate(lm, cfg, data)
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
