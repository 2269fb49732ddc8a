"""The ``ptq4vit`` preset: PTQ4ViT's released calibration, checked against its plain definition.

The side-by-side run against the released code itself is in the README (the code is not part
of vizq); here the chunked, vectorised searches are checked against a one-candidate-at-a-time
reading of the same rules, on the bundled model's real tensors.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vizq.ptq import ptq4vit
from vizq.ptq.config import QuantConfig
from vizq.ptq.engine import QuantizedModel
from vizq.ptq.evaluate import calibration_batch
from vizq.quant import get_quantizer
from vizq.quant.twin import GELU_MIN, STEP_FRACTIONS


@pytest.fixture(scope="module")
def setup(bundled):
    cfg = QuantConfig(preset="ptq4vit", wbits=4, abits=4, calibration={"images": 8})
    images, _ = calibration_batch(bundled, cfg)
    qm = QuantizedModel(bundled, cfg)
    with torch.no_grad():
        target = F.softmax(bundled.model(images), -1)
    layers = {l.name: l for l in ptq4vit.layers(qm)}
    caps = ptq4vit._capture(qm, [l for l in layers.values() if l.stage == 1], images, target, None)
    yield bundled, qm, images, layers, caps
    qm.remove_hooks()


def _sym(x, s, q):
    return torch.clamp(torch.round(x / s), -q, q - 1) * s


def _err(raw, o, dims):
    """The released score as an error (lower is better): mean squared output error over the
    output features and tokens, summed over images."""
    e = (raw - o).pow(2).mean(-1)
    return e.mean(dims).sum(0) if dims else e.sum(0)


def test_layers_are_the_released_codes_in_network_order(setup):
    _, qm, _, layers, _ = setup
    names = list(layers)
    assert names[0] == "patch_embed.proj" and names[-1] == "head"
    assert names[1:7] == ["blocks.0.attn.qkv", "blocks.0.attn.matmul1", "blocks.0.attn.matmul2",
                          "blocks.0.attn.proj", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"]
    assert layers["blocks.0.attn.qkv"].n_v == 3 and layers["blocks.0.mlp.fc1"].n_v == 1
    assert layers["patch_embed.proj"].a not in qm.acts  # the image input stays float
    assert layers["blocks.0.mlp.fc2"].a == "blocks.0.mlp.act" and layers["head"].a == "head:input"
    assert qm.acts["blocks.0.attn.q"].q.options["granularity"] == "head"


def test_capture_is_the_float_network_and_its_gradient_is_rounding_noise(setup):
    bundled, _, images, _, caps = setup
    seen = {}

    def keep(key, with_input=False):
        def hook(mod, args, out):
            seen[key] = (args[0], out) if with_input else out
        return hook

    blk = bundled.model.blocks[1]
    hooks = [blk.mlp.fc1.register_forward_hook(keep("fc1", True)), blk.attn.q.register_forward_hook(keep("q")),
             blk.attn.k.register_forward_hook(keep("k"))]
    with torch.no_grad():
        bundled.model(images)
    for h in hooks:
        h.remove()
    fc1 = caps["blocks.1.mlp.fc1"]
    assert torch.equal(fc1.a, seen["fc1"][0]) and torch.equal(fc1.out, seen["fc1"][1])
    mm1 = caps["blocks.1.attn.matmul1"]
    assert torch.equal(mm1.out, seen["q"] @ seen["k"].transpose(-2, -1))
    # the metric's gradient is that of KL(p_FP || p) at p = p_FP: rounding noise, not curvature
    # (the released code's issue #23), far below the output it weighs
    assert float(fc1.grad.abs().max()) < 1e-6 * float(fc1.out.abs().max())


@pytest.mark.parametrize("name, gelu", [("blocks.1.mlp.fc1", False), ("blocks.1.mlp.fc2", True),
                                        ("blocks.1.attn.qkv", False)])
def test_linear_search_is_the_alternating_grid_search_it_describes(setup, name, gelu):
    bundled, qm, _, layers, caps = setup
    l, cap = layers[name], caps[name]
    mod = qm.model.get_submodule(name)
    w, b = qm.fp_weights[name], mod.bias
    wq = get_quantizer("uniform_sym", 4, granularity="out_channel" if l.n_v > 1 else "tensor")
    aq = get_quantizer("ptq4vit_gelu" if gelu else "uniform_sym", 4)
    with torch.no_grad():
        ptq4vit._search_linear(l, cap, w, b, wq, aq, ptq4vit.Metric.L2)
    # the plain reading, one candidate at a time
    fr, q, x, raw = torch.tensor(STEP_FRACTIONS), 8, cap.a, cap.out
    rows = w.shape[0] // l.n_v
    w0 = torch.stack([w[v * rows:(v + 1) * rows].abs().max() for v in range(l.n_v)]) / (q - 0.5)
    a0 = (x.max() if gelu else x.abs().max()) / (q - 0.5)
    neg = torch.tensor(GELU_MIN / q)

    def qin(a):
        if gelu:
            return torch.clamp(torch.round(x / a), 0, q - 1) * a + torch.clamp(torch.round(x / neg), -q, 0) * neg
        return _sym(x, a, q)

    def qw(steps):
        return torch.cat([_sym(w[v * rows:(v + 1) * rows], steps[v], q) for v in range(l.n_v)])

    ws, a = w0.clone(), a0
    with torch.no_grad():
        for _ in range(ptq4vit.ROUNDS):
            xin = qin(a)
            errs = torch.stack([_err(raw.view(*raw.shape[:-1], l.n_v, rows),
                                     F.linear(xin, qw(fr[i] * w0), b).view(*raw.shape[:-1], l.n_v, rows), [1])
                                for i in range(len(fr))])  # [100, n_v]
            ws = fr[errs.argmin(0)] * w0
            errs = torch.stack([_err(raw, F.linear(qin(fr[j] * a0), qw(ws), b), [1]) for j in range(len(fr))])
            a = fr[errs.argmin(0)] * a0
    torch.testing.assert_close(wq.state["scale"], ws.repeat_interleave(rows) if l.n_v > 1 else ws, rtol=0, atol=0)
    torch.testing.assert_close(aq.state["scale"], a.reshape(1), rtol=0, atol=0)
    if gelu:
        assert float(aq.state["neg_scale"]) == pytest.approx(GELU_MIN / q)


def test_matmul_searches_per_head_and_the_softmax_split_against_float_v(setup):
    _, qm, _, layers, caps = setup
    heads = 3
    with torch.no_grad():
        # q @ kᵀ: symmetric, one step per head for each operand
        l, cap = layers["blocks.1.attn.matmul1"], caps["blocks.1.attn.matmul1"]
        aq, bq = (get_quantizer("uniform_sym", 4, granularity="head") for _ in range(2))
        ptq4vit._search_matmul(l, cap, aq, bq, ptq4vit.Metric.L2)
        fr, q = torch.tensor(STEP_FRACTIONS), 8
        A, B, raw = cap.a, cap.b, cap.out
        a0, b0 = A.abs().amax((0, 2, 3)) / (q - 0.5), B.abs().amax((0, 2, 3)) / (q - 0.5)
        sa, sb = a0.clone(), b0.clone()
        hs = lambda s: s.view(1, heads, 1, 1)  # noqa: E731
        for _ in range(ptq4vit.ROUNDS):
            errs = torch.stack([_err(raw, _sym(A, hs(fr[i] * a0), q) @ _sym(B, hs(sb), q), [2]) for i in range(100)])
            sa = fr[errs.argmin(0)] * a0
            errs = torch.stack([_err(raw, _sym(A, hs(sa), q) @ _sym(B, hs(fr[i] * b0), q), [2]) for i in range(100)])
            sb = fr[errs.argmin(0)] * b0
        torch.testing.assert_close(aq.state["scale"], sa, rtol=0, atol=0)
        torch.testing.assert_close(bq.state["scale"], sb, rtol=0, atol=0)
        # attn @ v: the split is chosen with v in float, summed over heads
        l, cap = layers["blocks.1.attn.matmul2"], caps["blocks.1.attn.matmul2"]
        aq, bq = get_quantizer("ptq4vit_softmax", 4), get_quantizer("uniform_sym", 4, granularity="head")
        ptq4vit._search_matmul(l, cap, aq, bq, ptq4vit.Metric.L2)
        P, V, raw = cap.a, cap.b, cap.out
        errs = torch.stack([((raw - aq._apply(P, {"split": torch.tensor(s)}) @ V) ** 2).mean(-1).mean((1, 2)).sum()
                            for s in ptq4vit.SPLITS])
        assert float(aq.state["split"]) == ptq4vit.SPLITS[int(errs.argmin())]


def test_ptq4vit_end_to_end_exports_and_reloads_bit_exactly(bundled, tmp_path):
    from vizq.ptq.evaluate import eval_split, evaluate
    from vizq.ptq.export import export, load_export

    cfg = QuantConfig(preset="ptq4vit", wbits=8, abits=8, calibration={"images": 4})  # cost grows with images
    images, _ = calibration_batch(bundled, cfg)
    with QuantizedModel(bundled, cfg) as qm:
        steps = []
        qm.calibrate(images, progress=lambda d, t, w: steps.append((d, t)))
        assert steps[-1][0] == steps[-1][1] == len(qm.acts) + len(qm.weights)
        ims, idx = eval_split(bundled, cfg, None, 64)
        r = evaluate(bundled, qm, ims, idx, site_sqnr=False)
        assert r.agreement >= 95.0
        out = export(qm, tmp_path / "p4", [])
        x = images[:4]
        with load_export(out, bundled) as again:
            assert torch.equal(again(x), qm(x))
        assert "blocks.0.attn.patch_embed" not in qm.acts and "patch_embed.proj:input" not in qm.acts
