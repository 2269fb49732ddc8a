"""The ``adalog-released`` preset: AdaLog's released calibration (vizq/ptq/adalog.py).

The side-by-side run against the released code itself is in the README (the code is not part
of vizq); here the pieces are checked against their definitions and the whole procedure on the
bundled model's real tensors.
"""
from __future__ import annotations

import pytest
import torch

from vizq.ptq import adalog
from vizq.ptq.config import QuantConfig
from vizq.ptq.engine import QuantizedModel
from vizq.ptq.evaluate import calibration_batch
from vizq.quant import get_quantizer
from vizq.quant.step import StepFunction


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_released_table_quantizer_is_the_codes_forward(bits):
    """vizq's AdaLog quantizer with the released table equals the code's forward bit for bit
    (codes, shift + table dequantization, the 1e-15 floor, values past the last code), and so
    does its compiled step function."""
    g = torch.Generator().manual_seed(bits)
    x = torch.cat([torch.rand(20000, generator=g) ** 6 * 1.3, torch.tensor([0.0, 1e-16, 1e-15, 2e-15, 1.0, 5.0])])
    for q in (10, 23, 37, 51, 100, 137):
        scale = torch.tensor([0.8])
        quant = get_quantizer("adalog", bits, signed=False, table="released")
        quant.axis, quant.state = None, {"scale": scale, "base_q": torch.tensor([float(q)])}
        ref = adalog.adalog_fq(x, scale, q, bits)
        assert torch.equal(quant.fake_quant(x), ref), q
        step = StepFunction.build(quant, x)
        assert step is not None and torch.equal(step(x), ref), q
    # the fixed-point table is a different (finer) one: it must not be used by accident
    fine = get_quantizer("adalog", bits, signed=False)
    fine.axis, fine.state = None, {"scale": torch.tensor([0.8]), "base_q": torch.tensor([51.0])}
    assert not torch.equal(fine.fake_quant(x), adalog.adalog_fq(x, torch.tensor([0.8]), 51, bits))


def test_fpcs_refines_far_below_the_coarse_grid():
    """FPCS keeps the best candidates and refines around them: on a score peaked at a known
    scale it ends within the sixth pass's spacing, far closer than any coarse candidate."""
    target = 0.123456
    scales = torch.linspace(0.05, 0.3, adalog.EQ_N).view(1, -1)
    zps = torch.zeros_like(scales, dtype=torch.long)
    kept = {}

    def search(s, z, k):
        idx = torch.topk(-(s - target) ** 2, k=k, dim=-1).indices
        if k == 1:
            kept["s"] = float(s.gather(-1, idx))
        return idx

    adalog._fpcs(scales, zps, -1, search)
    spacing = float(scales[0, 1] - scales[0, 0])
    coarse = float((scales - target).abs().min())
    assert abs(kept["s"] - target) <= spacing / 7.5 ** 4 / 7 and abs(kept["s"] - target) < coarse / 100


def test_candidate_grid_spans_the_quantile_ranges():
    """Range candidates go from the 0.9..0.1 quantile spread to the full one; every zero point
    repeats them (the released code's percentile candidates)."""
    x = torch.randn(4, 50, 8)
    hi, lo = adalog._pct(x.device)
    up, low = adalog._quantile(x, hi)[:, None], adalog._quantile(x, lo)[:, None]
    s, z = adalog._grid(up, low, 8, 16, (1, 1), clamp=None)
    assert s.shape == (adalog.EQ_N, 1) and z.shape == s.shape
    q = torch.quantile(x.reshape(-1), torch.tensor([0.1, 0.9, 0.0, 1.0]).float())
    assert torch.allclose(s[0, 0], (q[1] - q[0]) / 15) and torch.allclose(s[7, 0], (q[3] - q[2]) / 15)
    assert torch.equal(s[:8], s[8:16]) and z[:8].eq(0).all() and z[-8:].eq(15).all()


TINY = ("random:vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "embed_dim": 48, "depth": 2, "num_heads": 3})


def test_whole_procedure_on_a_tiny_vit(tmp_path):
    """calibrate() end to end (a whole model takes minutes on a CPU even at the digits model's
    size: 128 candidates × 6 passes × 3 rounds a layer): every quantizer calibrated, weights
    fake-quantized, the export reloads bit for bit (the released table survives), the original
    model untouched, no hooks left. (On random weights AdaLog's
    log softmax is no better than min/max, so only the size of the error is bounded here; the
    real model is compared with the released code in the README.)"""
    from vizq.models import load_model
    from vizq.capture import hook_count

    torch.manual_seed(0)
    m = load_model(TINY[0], **TINY[1])
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    orig = {k: v.clone() for k, v in m.model.state_dict().items()}
    ticks = []
    qm = QuantizedModel(m, QuantConfig(preset="adalog-released", wbits=6, abits=6)).calibrate(
        x, progress=lambda d, t, what: ticks.append((d, t)))
    assert ticks[-1] == (len(adalog.layers(qm)), len(adalog.layers(qm)))
    assert all(a.q.calibrated for a in qm.acts.values()) and all(w.calibrated for w in qm.weights.values())
    with torch.no_grad():
        ref, out = m.model(x), qm(x)
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    assert float((out - ref).norm() / ref.norm()) < 0.5
    from vizq.ptq.export import export, load_export

    export(qm, tmp_path / "e", ["x"])
    back = load_export(tmp_path / "e", m)
    with torch.no_grad():
        assert torch.equal(back(x), out)
    back.remove_hooks()
    assert all(torch.equal(v, orig[k]) for k, v in m.model.state_dict().items())
    qm.remove_hooks()
    assert hook_count(m.model) == 0


@pytest.fixture(scope="module")
def block0(bundled):
    """The released procedure on block 0 of the bundled model's real tensors (2 images)."""
    cfg = QuantConfig(preset="adalog-released", wbits=8, abits=8, calibration={"images": 2})
    images, _ = calibration_batch(bundled, cfg)
    qm = QuantizedModel(bundled, cfg)
    site_of = {s.name: s for s in qm.sites}
    ls = [l for l in adalog.layers(qm) if l.name.startswith("blocks.0.")]
    with torch.no_grad():
        for group in adalog._groups(ls):
            caps = adalog._capture(qm, group, images)
            for l in group:
                (adalog._product(qm, l, caps[l.name]) if l.op == "matmul" else adalog._layer(qm, l, caps[l.name], site_of))
    yield bundled, qm, images, ls
    qm.remove_hooks()


def test_every_quantizer_is_searched_as_the_released_code_does(block0):
    bundled, qm, images, ls = block0
    kinds = {s.name: s.kind for s in qm.sites}
    sites = {n for l in ls for n in (l.a, l.b) if n in qm.acts}
    assert {kinds[n] for n in sites} == {"post_ln", "q", "k", "v", "post_softmax", "attn_proj_in", "post_gelu"}
    for name in sites:
        a = qm.acts[name]
        st = a.q.state
        if kinds[name] in ("post_softmax", "post_gelu"):
            assert a.q.name == "adalog" and a.q.options["table"] == "released"
            assert 10 <= float(st["base_q"]) <= 137 and float(st["base_q"]).is_integer()
            if kinds[name] == "post_softmax":
                assert float(st["scale"]) == 1.0
            else:
                assert a.shift == adalog.GELU_SHIFT
        else:  # asymmetric uniform with integer zero points, per head for q, k and v
            assert a.q.name == "uniform" and torch.equal(st["zero_point"], st["zero_point"].round())
            assert st["scale"].numel() == (qm.model.blocks[0].attn.num_heads if kinds[name] in ("q", "k", "v") else 1)
    for l in ls:
        if l.op == "linear":
            w = qm.weights[l.name]
            assert w.state["scale"].numel() == qm.fp_weights[l.name].shape[0]
            assert torch.equal(w.state["zero_point"], w.state["zero_point"].round())


def test_post_ln_is_folded_with_the_rounded_mean_zero_point(block0):
    bundled, qm, images, _ = block0
    folded = [n for n in ("blocks.0.norm1", "blocks.0.norm2") if n in qm.folds]
    assert len(folded) == 2
    for name in folded:
        f = qm.folds[name]
        assert float(f.zero_point).is_integer() and abs(float(f.ratio.mean()) - 1) < 1e-5
        assert float(qm.acts[name].q.state["zero_point"]).is_integer()
    # the folded float network (weights not yet fake-quantized) is the original function
    qm.passthrough = True
    try:
        with torch.no_grad():
            out = qm.model(images)
    finally:
        qm.passthrough = False
    with torch.no_grad():
        ref = bundled.model(images)
    assert 0 < float((out - ref).norm() / ref.norm()) < 1e-5
