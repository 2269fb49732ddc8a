"""The quantizer zoo: formulas, value sets, invariants, round trips and errors."""
from __future__ import annotations

import json
import math

import pytest
import torch

from vizq.quant import QuantizerError, get_quantizer, list_quantizers
from vizq.quant.fp import FORMATS, format_values, round_to_format
from vizq.quant.logq import logsqrt2_dequant, logsqrt2_direct
from vizq.quant.registry import quantizer_from_dict

ALL = list_quantizers()
#: Quantizers built for one activation's range (PTQ4ViT's released forms): values outside it
#: cannot be represented by design (the softmax grid spans [0, 1], the GELU grid's negative
#: side stops at GELU's minimum).
DOMAIN = {
    "ptq4vit_softmax": (0.0, 1.0),
    "ptq4vit_gelu": (-0.17, float("inf")),
    "sulq_released": (0.0, float("inf")),  # I&S-ViT's softmax quantizer: negatives clamp to 0
}


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 3, 33, 33, generator=g) * 3, -1)
    acts = torch.randn(512, 64, generator=g) * torch.linspace(0.1, 6, 64)
    gelu = torch.nn.functional.gelu(torch.randn(256, 64, generator=g) * 2)
    return {"probs": probs, "acts": acts, "gelu": gelu}


def _on_levels(q, x, y) -> bool:
    lv = q.levels()
    if lv.dim() == 1:
        return bool(torch.isin(y, lv).all())
    groups = y.movedim(q.axis, 0).reshape(lv.shape[0], -1)
    return all(bool(torch.isin(groups[i], lv[i]).all()) for i in range(lv.shape[0]))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("data", ["probs", "acts", "gelu"])
def test_outputs_lie_on_levels_and_are_idempotent(name, data):
    x = _data()[data]
    q = get_quantizer(name).calibrate(x)
    y = q.fake_quant(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert _on_levels(q, x, y)
    if name == "nvfp4" and data == "probs":
        # tiny probability blocks get subnormal E4M3 block scales; re-deriving a scale from an
        # already rounded block is not a fixed point there (a property of the format)
        return
    if name == "ptq4vit_softmax" and float(q.state["split"]) >= 1 / (2**q.bits - 2):
        # the released formula adds the split to every value above it, and once the split is
        # half a coarse step or more, that offset moves a re-quantized level (checked below)
        assert not torch.equal(q.fake_quant(y), y)
        return
    assert torch.equal(q.fake_quant(y), y)


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("mxfp8", "mxfp6", "mxfp4", "nvfp4", "ptq4vit_softmax")])
def test_per_channel_levels(name):
    x = _data()["acts"]
    q = get_quantizer(name, granularity="channel").calibrate(x)
    y = q.fake_quant(x)
    assert q.levels().shape[0] == 64
    assert _on_levels(q, x, y)
    assert torch.equal(q.fake_quant(y), y)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_uniform_error_bounded_by_half_step(bits):
    x = _data()["acts"]
    q = get_quantizer("uniform", bits).calibrate(x)
    s = float(q.state["scale"])
    err = (q.fake_quant(x) - x).abs().max()
    assert err <= s / 2 + 1e-6
    qs = get_quantizer("uniform_sym", bits).calibrate(x)
    ss = float(qs.state["scale"])
    inside = x.abs() <= ss * (2 ** (bits - 1) - 1)
    assert (qs.fake_quant(x) - x)[inside].abs().max() <= ss / 2 + 1e-6


@pytest.mark.parametrize("method", ["minmax", "percentile", "mse", "omse"])
def test_per_channel_never_worse_than_per_tensor(method):
    x = _data()["acts"]
    for bits in (3, 4, 6):
        pt = get_quantizer("uniform", bits, method=method).calibrate(x)
        pc = get_quantizer("uniform", bits, method=method, granularity="channel").calibrate(x)
        assert ((pc.fake_quant(x) - x) ** 2).mean() <= ((pt.fake_quant(x) - x) ** 2).mean()


def test_searches_do_not_lose_to_minmax():
    x = _data()["acts"]
    mm = ((get_quantizer("uniform", 4).calibrate(x).fake_quant(x) - x) ** 2).mean()
    for method in ("mse", "omse"):
        err = ((get_quantizer("uniform", 4, method=method).calibrate(x).fake_quant(x) - x) ** 2).mean()
        assert err <= mm


def test_logsqrt2_decomposition_equals_direct_formula():
    c = torch.arange(0, 64, dtype=torch.float32)
    for s in (1.0, 0.37, 2.5):
        assert torch.allclose(logsqrt2_dequant(c, torch.tensor(s)), logsqrt2_direct(c, torch.tensor(s)), rtol=1e-6, atol=0)


def test_logsqrt2_matches_reference_formula():
    p = _data()["probs"]
    q = get_quantizer("logsqrt2", 4, method="max").calibrate(p)
    s = q.state["scale"]
    code = torch.round(-2 * torch.log2(p / s))
    ref = torch.where(code >= 16, torch.zeros_like(p), s * 2 ** (-code.clamp(0, 15) / 2))
    assert torch.allclose(q.fake_quant(p), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", [3, 4, 6])
def test_adalog_base_37_equals_log2(bits):
    p = _data()["probs"]
    a = get_quantizer("adalog", bits, base_q=37).calibrate(p)
    l2 = get_quantizer("log2", bits)
    l2.axis, l2.state = None, {"scale": a.state["scale"].clone()}
    assert torch.equal(a.fake_quant(p), l2.fake_quant(p))


@pytest.mark.parametrize("bits", [3, 4])
def test_adalog_level_table_is_the_hardware_dequantization_bit_for_bit(bits):
    """AdaLog reads levels from a per-scale table; the hardware form shifts by floor(c·q/37) and
    looks up 2^(-j/37) in 16-bit fixed point for each value. Both must give the same bits."""
    from vizq.quant.logq import ADALOG_R, adalog_table

    p = _data()["probs"]
    a = get_quantizer("adalog", bits).calibrate(p)
    s, q = a.state["scale"].reshape(()), a.state["base_q"].reshape(())
    code = torch.round(-torch.log2((p / s).clamp_min(torch.finfo(torch.float32).tiny)) * ADALOG_R / q)
    e = code.clamp(0, 2**bits - 1) * q
    shift = torch.floor(e / ADALOG_R)
    hw = s * torch.exp2(-shift) * adalog_table()[(e - shift * ADALOG_R).long()]
    ref = torch.where(code >= 2**bits, torch.zeros_like(p), hw)
    assert torch.equal(a.fake_quant(p), ref)
    assert float(q) != 37  # a searched base, not plain log2


def test_log2_matches_fqvit_formula():
    p = _data()["probs"]
    q = get_quantizer("log2", 4).calibrate(p)
    code = torch.round(-torch.log2(p / q.state["scale"]))
    ref = torch.where(code >= 16, torch.zeros_like(p), q.state["scale"] * 2 ** -code.clamp(0, 15))
    assert torch.equal(q.fake_quant(p), ref)


def test_sulq_and_tanq_cover_zero_and_max():
    p = _data()["probs"]
    for name in ("sulq", "tanq"):
        q = get_quantizer(name, 4).calibrate(p)
        lv = q.levels()
        assert float(lv.min()) == 0.0
        assert math.isclose(float(lv.max()), float(p.max()), rel_tol=1e-5)
        assert lv.numel() == 16


def test_fp_value_sets():
    e2m1 = format_values("e2m1").tolist()
    assert e2m1 == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert float(format_values("e4m3").max()) == 448.0
    assert float(format_values("e5m2").max()) == 57344.0
    assert float(format_values("e3m2").max()) == 28.0
    assert float(format_values("e2m3").max()) == 7.5
    # 2^(e+m) magnitudes minus NaN/inf encodings
    assert format_values("e4m3").numel() == 127  # 0x00..0x7E (0x7F is NaN)
    assert format_values("e5m2").numel() == 124  # exponent 31 is inf/NaN
    assert format_values("e2m1").numel() == 8


def test_fp_round_to_nearest_even_and_saturate():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -2.5, -5.0])
    # ties go to the even mantissa: 0.25->0 (0 even), 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert round_to_format(x, "e2m1").tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -2.0, -4.0]
    # E4M3: between 256 and 288 the tie 272 goes to 256 (mantissa 000)
    assert round_to_format(torch.tensor([272.0, 304.0, 1e6]), "e4m3").tolist() == [256.0, 320.0, 448.0]


def test_fp_quantizer_scale_maps_max_to_format_max():
    x = _data()["acts"]
    q = get_quantizer("fp8_e4m3").calibrate(x)
    assert math.isclose(float(q.state["scale"]) * 448.0, float(x.abs().max()), rel_tol=1e-6)
    assert math.isclose(float(q.fake_quant(x).abs().max()), float(x.abs().max()), rel_tol=1e-6)


def test_mx_block_scales_are_powers_of_two():
    x = _data()["acts"] * 3.7
    for name in ("mxfp8", "mxfp6", "mxfp4"):
        q = get_quantizer(name).calibrate(x)
        sc = q.state["block_scales"]
        assert torch.equal(torch.exp2(torch.round(torch.log2(sc))), sc)
        # every block's max lands inside the element range
        emax = FORMATS[q.element].max_value
        blocks = x.reshape(-1, 32)
        s = q.block_scales(blocks)
        assert bool(((blocks.abs().amax(-1, keepdim=True) / s) < 2 * 2 ** FORMATS[q.element].emax).all())
        assert emax > 0


def test_nvfp4_block_scales_are_e4m3_values():
    x = _data()["acts"]
    q = get_quantizer("nvfp4").calibrate(x)
    s = q.e4m3_block_scales(x).flatten()
    assert torch.equal(round_to_format(s, "e4m3"), s)
    assert s.max() <= 448.0
    assert q.block_size == 16


@pytest.mark.parametrize("name", ALL)
def test_to_dict_round_trip_is_exact(name):
    x = _data()["gelu"]
    q = get_quantizer(name).calibrate(x)
    d = json.loads(json.dumps(q.to_dict()))
    q2 = quantizer_from_dict(d)
    assert torch.equal(q.fake_quant(x), q2.fake_quant(x))
    assert q2.to_dict() == q.to_dict()


def test_clear_errors():
    with pytest.raises(QuantizerError, match="unknown quantizer 'nope'"):
        get_quantizer("nope")
    with pytest.raises(QuantizerError, match="unknown option"):
        get_quantizer("uniform", 4, colour="red")
    with pytest.raises(QuantizerError, match="out of range"):
        get_quantizer("log2", 12)
    with pytest.raises(QuantizerError, match="8 bits wide|out of range"):
        get_quantizer("fp8_e4m3", 4)
    with pytest.raises(QuantizerError, match="empty"):
        get_quantizer("uniform").calibrate(torch.empty(0))
    with pytest.raises(QuantizerError, match="non-finite"):
        get_quantizer("uniform").calibrate(torch.tensor([1.0, float("nan")]))
    with pytest.raises(QuantizerError, match="before fake_quant"):
        get_quantizer("uniform").fake_quant(torch.ones(3))
    with pytest.raises(QuantizerError, match="method"):
        get_quantizer("uniform", method="magic")


def test_bits_range_2_to_8_for_int_and_log():
    x = _data()["probs"]
    for name in ("uniform", "uniform_sym", "log2", "logsqrt2", "adalog", "sulq", "tanq", "twin"):
        errs = [((get_quantizer(name, b).calibrate(x).fake_quant(x) - x) ** 2).mean() for b in range(2, 9)]
        assert errs[-1] < errs[0], name


def test_on_bundled_attention_log_quantizers_beat_uniform(bundled_capture):
    from vizq.lab import compare, lab_input

    inp = lab_input(bundled_capture, "blocks.2.attn.softmax")
    rows = {r["quantizer"]: r for r in compare(inp, [(n, 4, {}) for n in ("uniform", "logsqrt2", "adalog")])}
    assert rows["logsqrt2"]["attn_output_error"] < rows["uniform"]["attn_output_error"]
    assert rows["adalog"]["attn_output_error"] < rows["uniform"]["attn_output_error"]


def test_on_bundled_post_ln_per_channel_wins_widely(bundled, bundled_capture):
    from vizq.lab import compare, lab_input

    for site in ("blocks.3.norm1", "blocks.5.norm2"):
        inp = lab_input(bundled_capture, site, bundled.model)
        pt, pc = compare(inp, [("uniform", 4, {}), ("uniform", 4, {"granularity": "channel"})])
        assert pc["mse"] < 0.5 * pt["mse"], site
        assert pc["linear_output_error"] < pt["linear_output_error"]


# ---------------------------------------------------------------- defined numerics
BLOCK = [n for n in ALL if "block_size" in get_quantizer(n).options]


@pytest.mark.parametrize("name", ALL)
def test_non_finite_values_follow_one_rule(name):
    """NaN in → NaN out; ±inf saturate at the extreme levels; no other value changes (compared
    with the same tensor where the non-finite values are 0)."""
    x = _data()["gelu"]
    q = get_quantizer(name).calibrate(x)
    y = x.clone()
    for i, j in ((0, 3), (5, 40), (100, 0), (7, 31)):
        y[i, j] = math.nan
    y[1, 1], y[2, 2] = math.inf, -math.inf
    out = q.fake_quant(y)
    ref = q.fake_quant(torch.where(torch.isfinite(y), y, torch.zeros_like(y)))
    assert torch.equal(torch.isnan(out), torch.isnan(y))
    finite = torch.isfinite(y)
    assert torch.equal(out[finite], ref[finite])
    assert torch.isfinite(out[1, 1]) and torch.isfinite(out[2, 2])
    if name in BLOCK:  # the block's largest level, whatever the other values
        assert out[1, 1] >= out[1, :32].max() and out[2, 2] <= out[2, :32].min()
    else:
        lv = q.levels()
        assert out[1, 1] == lv.max() and out[2, 2] == lv.min()


@pytest.mark.parametrize("name", ALL)
def test_calibration_refuses_non_finite_data(name):
    x = _data()["gelu"].clone()
    x[3, 3] = math.nan
    with pytest.raises(QuantizerError, match="non-finite"):
        get_quantizer(name).calibrate(x)


@pytest.mark.parametrize("value", [-2.0, 1.5])  # (3.5 saturates to 3 in MXFP4 by the spec)
@pytest.mark.parametrize("name", ALL)
def test_a_constant_tensor_reproduces_itself(name, value):
    lo, hi = DOMAIN.get(name, (-float("inf"), float("inf")))
    if not lo <= value <= hi:
        value = hi if value > hi else lo / 2  # a constant inside the quantizer's domain
    x = torch.full((4, 64), value)
    y = get_quantizer(name).calibrate(x).fake_quant(x)
    assert torch.allclose(y, x, rtol=0.02), (name, y.flatten()[:4])


def test_twin_on_mostly_negative_data_covers_the_negative_range():
    g = torch.Generator().manual_seed(0)
    x = -torch.rand(4096, generator=g) * 2  # all in [-2, 0]
    q = get_quantizer("twin", 4).calibrate(x)
    err = (q.fake_quant(x) - x).abs().max()
    assert err <= 2 / 7 / 2 + 1e-6  # half a step of the 7 negative levels spanning [-2, 0]


@pytest.mark.parametrize("name", ["uniform", "uniform_sym"])
@pytest.mark.parametrize("scale", [1e-8, 1e-20, 1e20])
def test_uniform_levels_do_not_depend_on_the_magnitude(name, scale):
    """The same data times 1e-8 (or 1e20) quantizes to the same levels times the same factor:
    no fixed floor on the scale squeezes tiny activations onto a few levels."""
    x = torch.linspace(0.1, 3.0, 256)
    base = get_quantizer(name, 4).calibrate(x).fake_quant(x)
    tiny = get_quantizer(name, 4).calibrate(x * scale).fake_quant(x * scale)
    assert torch.allclose(tiny / scale, base, rtol=1e-4)


@pytest.mark.parametrize("name", BLOCK)
def test_block_formats_refuse_a_0_dim_tensor(name):
    with pytest.raises(QuantizerError, match="0-dim"):
        get_quantizer(name).calibrate(torch.tensor(1.5))
    q = get_quantizer(name).calibrate(torch.randn(64))
    with pytest.raises(QuantizerError, match="0-dim"):
        q.fake_quant(torch.tensor(1.5))


def test_granularity_is_a_value_with_its_scope():
    from vizq.quant import Granularity

    x = torch.randn(4, 8, 32)
    assert get_quantizer("uniform", 4).granularity is Granularity.TENSOR
    q = get_quantizer("uniform", 4, granularity=Granularity.CHANNEL).calibrate(x)
    assert q.granularity is Granularity.CHANNEL and q.granularity.scope == "per-axis" and q.options["granularity"] == "channel"
    assert json.loads(json.dumps(q.to_dict()))["options"]["granularity"] == "channel"  # written by name
    assert get_quantizer("mxfp4").granularity is Granularity.BLOCK and Granularity.BLOCK.scope == "per-block"
    assert get_quantizer("uniform", 4, granularity="out_channel").granularity.axis == 0
    with pytest.raises(QuantizerError, match="granularity='rows' is unknown"):
        get_quantizer("uniform", 4, granularity="rows")


def test_a_search_sample_is_never_reused_for_another_tensor_at_the_same_address():
    """Sequential calibration frees each site's tensor before it captures the next of the same
    shape; the allocator then often hands out the same address. The sample of the freed tensor
    must not be reused for the new one (it was: blocks.0.attn.k was calibrated on
    blocks.0.attn.q's sample in about one ptq4vit-mse calibration of two, which moved W6A6 top-1
    on the real ViT by up to 2 points from run to run)."""
    from vizq.quant.base import SEARCH_SAMPLE, _tail_sample, search_sample

    x = torch.empty(1, 4 * SEARCH_SAMPLE).normal_()  # a live tensor searched twice shares its sample
    assert search_sample(x.reshape(1, -1))[0] is search_sample(x.detach().reshape(1, -1))[0]
    reused = 0
    for i in range(40):
        a = torch.empty(1, 4 * SEARCH_SAMPLE).normal_()
        address = a.data_ptr()
        search_sample(a)
        del a
        b = torch.empty(1, 4 * SEARCH_SAMPLE).normal_(std=1.0 + i)  # new values, same shape and version
        reused += b.data_ptr() == address
        assert torch.equal(search_sample(b)[0], _tail_sample(b, SEARCH_SAMPLE)[0])
    if not reused:
        pytest.skip("the allocator never handed out a freed address here, so the case did not arise")
