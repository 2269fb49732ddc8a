"""The compiled CPU kernel gives the same bits as the torch path, and its absence is harmless."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from vizq.quant import get_quantizer, native
from vizq.quant.step import StepFunction

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the torch path is all there is")


def _probe() -> torch.Tensor:
    """Ordinary values plus the floats where lookups go wrong: zeros, subnormals, huge, NaN-free."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-140, 120, (200_000,), generator=g).float())
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0**-127, 2.0**-126, 1e38, -1e38, math.inf, -math.inf,
                            448.0, 449.0, 6.0, 6.5, 1.0, -1.0])
    return torch.cat([special, wide, torch.randn(100_000, generator=g) * 3])


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "probs": torch.softmax(torch.randn(8, 3, 65, 65, generator=g) * 3, -1),
        "gelu": torch.nn.functional.gelu(torch.randn(64, 65, 96, generator=g) * 2),
    }


@pytest.mark.parametrize("name,bits", [("uniform", 4), ("uniform", 8), ("twin", 4), ("log2", 4), ("logsqrt2", 4),
                                       ("logsqrt2", 8), ("adalog", 4), ("sulq", 4), ("tanq", 6), ("fp8_e4m3", 8),
                                       ("fp8_e5m2", 8), ("fp6_e3m2", 6), ("fp4_e2m1", 4)])
@pytest.mark.parametrize("data", ["probs", "gelu"])
def test_step_kernel_matches_binary_search_bit_for_bit(name, bits, data):
    x = _data()[data]
    q = get_quantizer(name, bits).calibrate(x)
    step = StepFunction.build(q, x)
    assert step is not None and step.native
    # every threshold, its neighbours one ulp away, the data and extreme floats
    t = step.thresholds
    edges = torch.cat([t, torch.nextafter(t, torch.full_like(t, -math.inf)), torch.nextafter(t, torch.full_like(t, math.inf))])
    for probe in (x, edges, _probe()):
        fast, ref = step(probe), step.reference(probe)
        assert torch.equal(fast.view(torch.int32), ref.view(torch.int32))
        assert torch.equal(fast, q.fake_quant(probe))


def test_step_kernel_passes_nan_through_and_leaves_neighbours_alone():
    x = _data()["probs"]
    q = get_quantizer("logsqrt2", 4).calibrate(x)
    step = StepFunction.build(q, x)
    y = x.clone().flatten()
    y[::1000] = math.nan
    y[1::1000] = -math.nan  # a NaN with the sign bit set lands in another bin of the table
    fast, ref = step(y), step.reference(y)
    nan = torch.isnan(y)
    assert torch.equal(torch.isnan(fast), nan) and torch.equal(torch.isnan(ref), nan)
    assert torch.equal(fast[~nan], ref[~nan]) and torch.equal(fast[~nan], step(x.flatten())[~nan])


def test_step_function_reaches_the_clamp_levels_of_a_fractional_zero_point():
    """RepQ-ViT's folded quantizers keep an unrounded zero point: the top level is then
    (qmax - z)·s, off the r·s grid that levels() lists. Found side by side with the reference."""
    q = get_quantizer("uniform", 4)
    q.axis, q.state = None, {"scale": torch.tensor([0.2934]), "zero_point": torch.tensor([7.6406])}
    step = StepFunction.build(q)
    x = torch.linspace(-5, 5, 100_001)
    assert step is not None and torch.equal(step(x), q.fake_quant(x))
    assert torch.equal(step.reference(x), q.fake_quant(x))


def test_step_kernel_handles_strided_and_parallel_inputs():
    q = get_quantizer("logsqrt2", 4).calibrate(_data()["probs"])
    step = StepFunction.build(q)
    qkv = torch.rand(4, 50, 3, 6, 64).permute(2, 0, 3, 1, 4)  # q/k/v: strided views of one tensor
    for view in (qkv[0], qkv[2], torch.rand(3 * (1 << 17) + 7)):  # and one big enough for every thread
        assert torch.equal(step(view), step.reference(view))


@pytest.mark.parametrize("name", ["mxfp4", "mxfp6", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape", [(4, 3, 65, 65), (64, 65, 96), (1000, 20), (7,)])
def test_block_kernel_matches_torch_path(monkeypatch, name, shape):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    q = get_quantizer(name).calibrate(x)
    wide = _probe()[: (_probe().numel() // 32) * 32].reshape(-1, 32)
    with_nan = wide.clone()
    with_nan[::7, 5] = math.nan
    for probe in (x, wide, with_nan):
        fast = q.fake_quant(probe)
        monkeypatch.setenv("VIZQ_NATIVE", "0")
        ref = q.fake_quant(probe)
        monkeypatch.delenv("VIZQ_NATIVE")
        nan = torch.isnan(probe)  # NaN passes through; ±inf saturate and never set a block's scale
        assert torch.equal(torch.isnan(fast), nan) and torch.equal(torch.isnan(ref), nan)
        assert torch.equal(fast[~nan], ref[~nan])


def test_mx_shared_exponent_is_floor_log2_even_just_below_a_power_of_two():
    below = torch.nextafter(torch.tensor(256.0), torch.tensor(0.0))
    assert float(torch.floor(torch.log2(below))) == 8.0  # float32 log2 rounds up to 8 here
    q = get_quantizer("mxfp4").calibrate(torch.ones(32))
    # OCP MX: X = 2^(floor(log2 amax) - emax) = 2^(7 - 2); 255.99998 / X saturates to 6 -> 192
    x = torch.cat([below.reshape(1), torch.zeros(31)])
    for env in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VIZQ_NATIVE", env)
            assert float(q.fake_quant(x)[0]) == 192.0


def test_missing_compiler_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setenv("VIZQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(RuntimeWarning, match="kernel unavailable"):
        assert native.library() is None
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    q = get_quantizer("logsqrt2", 4).calibrate(_data()["probs"])
    step = StepFunction.build(q)
    x = _data()["probs"]
    assert torch.equal(step(x), q.fake_quant(x))


def test_kernel_builds_into_an_empty_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setenv("VIZQ_CACHE_DIR", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is not None
    assert [p.suffix for p in tmp_path.iterdir()] == [".so"]  # one finished library, no temp files


def test_damaged_cached_library_is_rebuilt(monkeypatch, tmp_path):
    for d in ("first", "damaged"):
        monkeypatch.setattr(native, "_tried", False)
        monkeypatch.setattr(native, "_lib", None)
        monkeypatch.setenv("VIZQ_CACHE_DIR", str(tmp_path / d))
        if d == "damaged":  # the cached file under its expected name, e.g. copied from elsewhere
            (tmp_path / d).mkdir()
            (tmp_path / d / name).write_bytes(b"not a shared library")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native.library() is not None
        (so,) = (tmp_path / d).iterdir()
        name = so.name
    assert so.read_bytes()[:4] == b"\x7fELF"
