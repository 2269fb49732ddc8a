"""Model & data: choose what to analyse, see its structure, capture activations."""
import pandas as pd
import streamlit as st

from vizq.capture import summary_rows
from vizq.models import BUNDLED, REAL_DEFAULT, SUPPORTED_ARCHS
from vizq.families.bert import MINILM
from vizq.sites import KIND_HELP, count_by_kind
from vizq.ui.state import chart_table, current_capture, current_model, data_label, guard, save_upload, units

st.title("Model & data")
s = st.session_state
archs = [a for names in SUPPORTED_ARCHS.values() for a in names]

with st.form("model"):
    modes = ["bundled", "timm", "checkpoint", "text"]
    mode = st.radio("Model", modes, horizontal=True, key="model_mode_widget", index=modes.index(s.model_mode),
                    format_func={"bundled": "Bundled (no download)", "timm": "timm architecture",
                                 "checkpoint": "Local checkpoint",
                                 "text": f"Text encoder ({MINILM}, real pretrained weights)"}.get)
    shipped = [REAL_DEFAULT, BUNDLED]
    pick_bundled = st.selectbox("Bundled model", shipped, index=shipped.index(s.model_spec) if s.model_spec in shipped else 0,
                                format_func={REAL_DEFAULT: f"{REAL_DEFAULT} (real ImageNet weights, 224 px)",
                                             BUNDLED: f"{BUNDLED} (trained here on digits, 32 px, fast)"}.get)
    arch = st.selectbox("Architecture (timm name; tags like .augreg_in21k_ft_in1k go in the box below)", archs)
    tag = st.text_input("Optional tag", "")
    random_init = st.checkbox("Random init (no download; for structure)", value=True)
    img_size = st.number_input("Input size (timm architectures)", 32, 1024, 224, step=16)
    ckpt_path = st.text_input("Checkpoint path (.safetensors / .pth), or a BERT folder with config.json for text", "")
    ckpt_file = st.file_uploader("…or upload a checkpoint", type=["safetensors", "pth", "pt"])
    if st.form_submit_button("Load model", type="primary"):
        kwargs = {} if mode == "bundled" else {"img_size": int(img_size)} if img_size != 224 else {}
        if mode == "bundled":
            spec = pick_bundled
        elif mode == "text":
            spec, kwargs = (ckpt_path.strip() or MINILM), {}
        elif mode == "timm":
            spec = ("random:" if random_init else "") + arch + (f".{tag.lstrip('.')}" if tag and not random_init else "")
        else:
            path = save_upload(ckpt_file) if ckpt_file else ckpt_path.strip()
            if not path:
                st.error("Give a checkpoint path or upload a file.")
                st.stop()
            spec = f"{arch}@{path}"
        s.model_mode, s.model_spec, s.model_kwargs = mode, spec, kwargs
        st.rerun()  # the sidebar was drawn before this form: draw it again with the new model

with st.form("data"):
    dmode = st.radio("Data", ["bundled", "folder", "upload"], horizontal=True,
                     index=["bundled", "folder", "upload"].index(s.data_mode),
                     format_func={"bundled": "Bundled set", "folder": "Folder on this machine",
                                  "upload": "Upload images"}.get)
    path = st.text_input("Folder (ImageNet val layout with synset folders, or a flat folder); "
                         "for text models a UTF-8 file with one sentence per line", s.data_path)
    files = st.file_uploader("Images (or one .txt file of sentences for text models)",
                             type=["jpg", "jpeg", "png", "webp", "bmp", "txt"], accept_multiple_files=True)
    c1, c2 = st.columns(2)
    n = c1.number_input("Samples to capture (images or sentences)", 1, 10000, int(s.n_images))
    seed = c2.number_input("Seed", 0, 2**31 - 1, int(s.seed))
    if st.form_submit_button("Use this data"):
        s.data_mode, s.data_path, s.n_images, s.seed = dmode, path.strip(), int(n), int(seed)
        if dmode == "upload":
            s.uploads = [(f.name, f.getvalue()) for f in files or []]
        st.rerun()  # the sidebar names the data: draw it again

lm = current_model()
info = lm.info
st.subheader(f"{info.model_id}")
shape = ([("input", "×".join(map(str, info.input_size))), ("patch grid", "×".join(map(str, info.patch_grid)))]
         if info.modality == "image" else
         [("input", f"token ids, ≤ {info.data_config.get('max_tokens', '?')} per sentence"),
          ("attention heads", info.data_config.get("heads", "?"))])
cols = st.columns(6)
for c, (label, value) in zip(cols, [("family", info.family), ("blocks", info.num_blocks),
                                    ("parameters", f"{info.num_params / 1e6:.2f} M"), *shape,
                                    ("weights", info.weights_source)]):
    c.metric(label, value)
st.caption(f"weights sha256 {info.weights_sha256[:16]}… · "
           + (f"{len(lm.class_names)} classes" if info.modality == "image" else "sentence embeddings, no padding"))
kinds = pd.DataFrame([{"kind": k, "sites": v, "what": KIND_HELP[k]} for k, v in count_by_kind(lm.sites).items()])
st.dataframe(kinds, hide_index=True, width="stretch")

force = st.button("Capture activations", type="primary")
cap = current_capture(lm, force=force)
st.success(f"Captured {cap.num_images} {units(lm)} ({data_label(lm)}) over {len(cap.stats)} sites in {cap.seconds:.1f}s.")
with guard("Summarising the capture"):
    chart_table(pd.DataFrame(summary_rows(cap)), "capture-summary")
