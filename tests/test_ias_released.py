"""The ``ias-released`` preset: I&S-ViT's released calibration (vizq/ptq/ias.py).

The side-by-side run against the released code itself is in the README (the code is not part
of vizq); here the pieces are checked against the released formulas on the bundled model's real
tensors, and the whole procedure end to end.
"""
from __future__ import annotations

import pytest
import torch

from vizq.ptq import ias
from vizq.ptq.config import ConfigError, QuantConfig
from vizq.ptq.engine import QuantizedModel
from vizq.quant import get_quantizer
from vizq.quant.logq import SULQ_RELEASED_SHIFTS, sulq_released
from vizq.quant.uniform import WIDE_PERCENTILES


def _released_search(x: torch.Tensor, bits: int) -> tuple[float, float, float]:
    """The released ``LogSqrt2Quantizer`` search, written out one candidate at a time: for each
    absolute shift, the log2 range of the shifted data split into 2^bits − 1 steps, codes
    rounded to integer exponents, MSE over everything; the first strictly best shift wins."""
    best, best_err = None, 1e10
    for b in SULQ_RELEASED_SHIFTS:
        y = torch.log(x + b) / torch.log(torch.tensor(2.0))
        lo, hi = float(y.min()), float(y.max())
        delta = (hi - lo) / (2**bits - 1)
        code = torch.round((y - lo) / delta).clamp(0, 2**bits - 1)
        err = float(((x - (2 ** torch.round(code * delta + lo) - b)) ** 2).mean())
        if err < best_err:
            best, best_err = (b, lo, hi), err
    return best


@pytest.mark.parametrize("bits", [3, 4, 6])
def test_sulq_released_is_the_released_search_and_forward(bundled_capture, bits):
    """On a real post-softmax tensor: the shift and log range are the released search's, the
    forward is the released one (2^bits steps, 2^bits + 1 codes), every output is a power of
    two minus the shift, and the straight-through form used in training has the same values and
    a gradient."""
    x = bundled_capture.site("blocks.3.attn.softmax").sample().float().reshape(-1)
    q = get_quantizer("sulq_released", bits, signed=False).calibrate(x)
    b, lo, hi = _released_search(x, bits)
    st = q.state
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731 - as torch adds a Python float
    assert float(st["shift"]) == f32(b) and float(st["lo"]) == f32(lo) and float(st["hi"]) == f32(hi)
    out = q.fake_quant(x)
    y = torch.log(x + b) / torch.log(torch.tensor(2.0))
    delta = (hi - lo) / 2**bits
    ref = 2 ** torch.round(torch.clamp(torch.round((y - lo) / delta), 0, 2**bits) * delta + lo) - b
    assert torch.allclose(out, ref, rtol=0, atol=1e-7)
    k = torch.log2(out + b)
    assert torch.allclose(k, k.round(), atol=1e-5)  # levels 2^k − b, k an integer
    assert len(torch.unique(out)) <= 2**bits + 1
    xs = x[:4096].clone().requires_grad_(True)
    ste = sulq_released(xs, st["shift"], st["lo"], st["hi"], q.n_codes, round_=ias._round_ste)
    assert torch.equal(ste.detach(), q.fake_quant(x[:4096]))
    ste.sum().backward()
    assert xs.grad is not None and torch.isfinite(xs.grad).all() and xs.grad.abs().sum() > 0


def test_percentile_wide_picks_the_best_of_nine_quantile_ranges(bundled):
    """Per output row of a real weight: the range is one of the nine quantile pairs, and none of
    the nine gives a lower MSE (ties keep the first, as the released code's loop does)."""
    w = bundled.model.blocks[0].mlp.fc1.weight.detach()[:24]
    q = get_quantizer("uniform", 4, granularity="out_channel", method="percentile_wide").calibrate(w)
    fq = q.fake_quant(w)
    got = ((w - fq) ** 2).mean(1)
    for r in range(w.shape[0]):
        errs = []
        for p in WIDE_PERCENTILES:
            hi = torch.quantile(w[r], p)
            lo = torch.quantile(w[r], 1 - p)
            s = (hi - lo) / 15
            z = torch.round(-lo / s)
            errs.append(float(((w[r] - (torch.clamp(torch.round(w[r] / s) + z, 0, 15) - z) * s) ** 2).mean()))
        assert float(got[r]) == pytest.approx(min(errs), rel=1e-5), r


def test_config_refuses_what_the_procedure_does_not_do():
    with pytest.raises(ConfigError, match="ias_iters sets the steps"):
        QuantConfig(preset="repq", ias_iters=5)
    with pytest.raises(ConfigError, match="recon_iters would add a third"):
        QuantConfig(preset="ias-released", recon_iters=10)
    with pytest.raises(ConfigError, match="non-negative integer"):
        QuantConfig(preset="ias-released", ias_iters=-1)
    assert ias.default_iters(QuantConfig(preset="ias-released")) == ias.ITERS
    assert ias.default_iters(QuantConfig(preset="ias-released", wbits=6, abits=6)) == ias.ITERS_W6A6
    assert ias.default_iters(QuantConfig(preset="ias-released", ias_iters=7)) == 7


def test_cli_refuses_ias_iters_without_the_preset():
    from tests.test_cli import vizq

    p = vizq("eval", "--ias-iters", "5", check=False)
    assert p.returncode == 2 and "ias_iters" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_whole_procedure_on_the_bundled_model(bundled, tmp_path):
    """calibrate() end to end with a few steps: units in network order, weights *and biases*
    trained, the post-LN fold made, progress counted to its end, the export reloads bit for bit
    (trained biases included), the original model untouched, no hooks left; cancelling stops it
    with the original weights intact."""
    from vizq.capture import Cancelled, hook_count
    from vizq.ptq.evaluate import calibration_batch
    from vizq.ptq.export import export, load_export

    cfg = QuantConfig(preset="ias-released", wbits=4, abits=4, ias_iters=3, calibration={"images": 8})
    images, _ = calibration_batch(bundled, cfg)
    orig = {k: v.clone() for k, v in bundled.model.state_dict().items()}
    qm = QuantizedModel(bundled, cfg)
    u = ias.units(qm)
    assert u[0] == "patch_embed.proj" and u[-1] == "head" and sum(n.startswith("blocks.") for n in u) == len(
        bundled.model.blocks)
    ticks = []
    qm.calibrate(images, progress=lambda d, t, what: ticks.append((d, t, what)))
    # the patch embedding trains nothing in stage 1 (nothing quantized inside) and costs no time,
    # so its steps are not counted: the first block starts at 0, or the ETA would be measured on free steps
    assert ticks[-1][0] == ticks[-1][1] == 3 * (2 * len(u) - 1)
    assert [d for d, _, w in ticks if w == "stage 1: blocks.0"][0] == 0
    assert all(a[0] <= b[0] and a[1] == b[1] for a, b in zip(ticks, ticks[1:]))
    assert any("stage 3" in w for _, _, w in ticks)
    assert qm.folds and all(a.q.calibrated for a in qm.acts.values())
    fc1 = qm.model.blocks[0].mlp.fc1
    assert not torch.equal(fc1.bias, orig["blocks.0.mlp.fc1.bias"])  # biases are trained too
    with torch.no_grad():
        ref, out = bundled.model(images), qm(images)
    assert torch.isfinite(out).all() and (out.argmax(1) == ref.argmax(1)).float().mean() >= 0.5
    export(qm, tmp_path / "e", ["x"])
    back = load_export(tmp_path / "e", bundled)
    with torch.no_grad():
        assert torch.equal(back(images), out)
    back.remove_hooks()
    qm.remove_hooks()
    assert all(torch.equal(v, orig[k]) for k, v in bundled.model.state_dict().items())
    assert hook_count(bundled.model) == 0

    qm = QuantizedModel(bundled, cfg)
    calls = []
    with pytest.raises(Cancelled):
        qm.calibrate(images, cancel=lambda: calls.append(1) or len(calls) > 2)
    qm.remove_hooks()
    assert all(torch.equal(v, orig[k]) for k, v in bundled.model.state_dict().items())
    assert hook_count(bundled.model) == 0
