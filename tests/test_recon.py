"""Block reconstruction (learned rounding with QDrop) on the bundled model's real digits."""
from __future__ import annotations

import pytest
import torch

from vizq.capture import Cancelled
from vizq.data import resolve_images
from vizq.ptq.config import QuantConfig
from vizq.ptq.engine import QuantizedModel
from vizq.ptq.evaluate import calibrate, calibration_batch
from vizq.ptq.export import export, load_export
from vizq.ptq.recon import _block_tensors

CFG = dict(preset="repq", wbits=3, abits=4)


@pytest.fixture(scope="module")
def pair(bundled):
    """The same calibration without and with 30 reconstruction steps per block."""
    base = calibrate(bundled, QuantConfig(**CFG)).qmodel
    rec = calibrate(bundled, QuantConfig(**CFG, recon_iters=30)).qmodel
    yield base, rec
    base.remove_hooks()
    rec.remove_hooks()


def held_out(bundled, n: int = 64) -> torch.Tensor:
    images = resolve_images(bundled, None, "eval")
    return torch.cat([x for x, _, _ in bundled.iterate(images, list(range(n)), n)])


def test_reconstruction_lowers_the_error_on_images_it_never_saw(bundled, pair):
    x = held_out(bundled)
    last = [s.module for s in pair[0].sites if s.kind == "residual"][-1]
    target = _block_tensors(bundled.model, last, x, inputs=False)[0]
    err = [float((_block_tensors(q.model, last, x, inputs=False)[0] - target).pow(2).mean()) for q in pair]
    assert err[1] < 0.9 * err[0], err
    with torch.no_grad():
        fp = bundled.model(x).log_softmax(-1)
        kl = [float((fp.exp() * (fp - q(x).log_softmax(-1))).sum(-1).mean()) for q in pair]
    assert kl[1] < kl[0], kl


def test_reconstructed_weights_stay_on_the_calibrated_grid_one_step_from_the_float_weight(pair):
    base, rec = pair
    assert rec.recon_modules and all(m.startswith("blocks.") for m in rec.recon_modules)
    moved = 0
    for p in rec.recon_modules:
        q = rec.weights[p]
        w = rec.model.get_submodule(p).weight.detach()
        assert torch.equal(q.fake_quant(w), w)  # a grid point maps to itself
        assert torch.equal(q.state["scale"], base.weights[p].state["scale"])  # scales as calibrated
        s = q._view(q.state["scale"], w)
        codes, fl = torch.round(w / s), torch.floor(base.fp_weights[p] / s)
        z = q._view(q.state["zero_point"], w)
        lo, hi = -z, 2**q.bits - 1 - z  # the codes each channel's grid holds
        inside = (fl >= lo) & (fl + 1 <= hi)  # away from the clamp, only floor or floor + 1
        assert bool(((codes == fl) | (codes == fl + 1))[inside].all())
        moved += int((codes != torch.round(base.fp_weights[p] / s)).sum())
    assert moved > 0  # it did change some roundings


def test_reconstruction_reproduces_bit_for_bit(bundled, pair):
    """QDrop's masks come from a generator seeded by the calibration seed, not the global RNG."""
    cfg = QuantConfig(**CFG, recon_iters=10, calibration={"images": 8})  # small: equality is what is checked
    torch.manual_seed(1234)  # the global generator's state must not matter
    first = calibrate(bundled, cfg).qmodel
    torch.manual_seed(99)
    again = calibrate(bundled, cfg).qmodel
    assert first.recon_modules
    for p in first.recon_modules:
        assert torch.equal(again.fp_weights[p], first.fp_weights[p])
    first.remove_hooks()
    again.remove_hooks()


def test_reconstructed_model_exports_and_reloads_bit_exactly(bundled, pair, tmp_path):
    rec = pair[1]
    x = held_out(bundled, 16)
    back = load_export(export(rec, tmp_path / "r"), bundled)
    with torch.no_grad():
        assert torch.equal(back(x), rec(x))
    back.remove_hooks()


def test_qdrop_keeps_a_random_half_in_float_and_passes_gradients_straight_through(bundled):
    qm = QuantizedModel(bundled, QuantConfig(**CFG))
    x = torch.randn(200_000, requires_grad=True)
    out = torch.round(x.detach() * 2) / 2
    qm.drop = 0.5
    y = qm._straight_through(x, out)
    kept = y.detach() == x.detach()
    assert bool((kept | (y.detach() == out)).all())
    assert abs(float(kept.float().mean()) - 0.5) < 0.01
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    qm.drop = 0.0
    assert torch.equal(qm._straight_through(x, out).detach(), out)
    qm.remove_hooks()


def test_cancel_stops_reconstruction_at_the_next_step(bundled):
    cfg = QuantConfig(**CFG, recon_iters=1000)
    x, _ = calibration_batch(bundled, cfg)
    seen: list[tuple[int, int]] = []
    with QuantizedModel(bundled, cfg) as qm, pytest.raises(Cancelled):
        qm.calibrate(x, recon_progress=lambda d, t, m: seen.append((d, t)), cancel=lambda: len(seen) > 3)
    assert seen and seen[-1][0] < 1000 and seen[0][1] == 1000 * len([s for s in qm.sites if s.kind == "residual"])


def test_weights_without_an_integer_grid_keep_their_rounding(bundled):
    cfg = QuantConfig(preset="fp8", wbits=8, abits=8, recon_iters=5)
    x, _ = calibration_batch(bundled, cfg)
    with QuantizedModel(bundled, cfg) as qm:
        qm.calibrate(x)
        assert qm.recon_modules == []


def test_learned_activation_scales_change_only_the_blocks_uniform_sites_and_export_exactly(bundled, tmp_path):
    small = dict(**CFG, recon_iters=10, calibration={"images": 8})  # which sites move is what is checked
    base = calibrate(bundled, QuantConfig(**small)).qmodel  # the same reconstruction without learned scales
    rec = calibrate(bundled, QuantConfig(**small, recon_scales=True)).qmodel
    blocks = tuple(s.module + "." for s in base.sites if s.kind == "residual")
    moved = 0
    for s in base.sites:
        if s.name not in base.acts:
            continue
        a, b = base.acts[s.name].q, rec.acts[s.name].q
        same = all(torch.equal(a.state[k], b.state[k]) for k in a.state)
        if not s.module.startswith(blocks) or a.name not in ("uniform", "uniform_sym"):
            assert same, s.name  # outside the blocks, and non-uniform grids, stay as calibrated
        else:
            moved += not same
            assert torch.equal(a.state.get("zero_point", 0), b.state.get("zero_point", 0))
    assert moved >= len(blocks)  # at least one per block
    x = held_out(bundled, 16)
    back = load_export(export(rec, tmp_path / "s"), bundled)
    with torch.no_grad():
        assert torch.equal(back(x), rec(x))
    for m in (back, rec, base):
        m.remove_hooks()


def test_learned_scales_need_reconstruction():
    from vizq.ptq.config import ConfigError

    with pytest.raises(ConfigError, match="recon_iters"):
        QuantConfig(**CFG, recon_scales=True)


def test_fused_lsq_matches_autograd_on_the_same_formula():
    """The fused fake-quant's value and gradients equal autograd's on the unfused formula
    (straight-through inside the grid's range, LSQ's d/ds), on values that clamp both ends."""
    from vizq.ptq.recon import _LsqFakeQuant

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 50, 8, generator=g) * 3).requires_grad_(True)
    s = torch.linspace(0.2, 0.6, 8).requires_grad_(True)
    z, up = torch.tensor(7.0), torch.randn(64, 50, 8, generator=g)
    xs = x / s
    inside = ((torch.round(xs) + z >= 0) & (torch.round(xs) + z <= 15)).float()
    code = torch.clamp(torch.round(xs) + z, 0, 15) - z
    ref = (xs * inside + (code - xs * inside).detach()) * s  # the value code·s; gradients by autograd
    gx, gs = torch.autograd.grad((ref * up).sum(), (x, s))
    out = _LsqFakeQuant.apply(x, s, z, 0, 15)
    fx, fs = torch.autograd.grad((out * up).sum(), (x, s))
    assert torch.allclose(out, ref, atol=1e-6) and 0 < float(inside.mean()) < 1
    assert torch.allclose(fx, gx, atol=1e-5) and torch.allclose(fs, gs, rtol=1e-4, atol=1e-3)


def test_minibatches_are_seeded_draws_without_replacement():
    from vizq.ptq.recon import _minibatches

    x = torch.arange(32.0).reshape(32, 1)
    draws = [_minibatches([x], [x * 2], 8, torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    a, b, c = ([d(it) for it in range(5)] for d in draws)
    for (xi, yi), (xj, _) in zip(a, b):
        assert len(xi) == 8 == len(set(xi.flatten().tolist())) and torch.equal(yi, xi * 2) and torch.equal(xi, xj)
    assert any(not torch.equal(xi, xk) for (xi, _), (xk, _) in zip(a, c))
    whole = _minibatches([x], [x], 0, torch.Generator())
    assert torch.equal(whole(3)[0], x)


def test_token_loss_is_mse_when_tokens_are_alike_and_discounts_a_massive_token():
    from vizq.ptq.config import ReconLoss
    from vizq.ptq.recon import block_loss

    g = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (2, 6, 8), generator=g) * 2.0 - 1  # every token's mean square is 1
    err = torch.randn(2, 6, 8, generator=g)
    assert torch.allclose(block_loss(signs + err, signs, ReconLoss.TOKEN), block_loss(signs + err, signs, ReconLoss.MSE))
    massive = signs.clone()
    massive[:, 0] *= 100  # token 0 is 10⁴ times the others in mean square
    on_massive = torch.zeros_like(err)
    on_massive[:, 0] = 1.0
    on_ordinary = torch.zeros_like(err)
    on_ordinary[:, 1] = 1.0
    mse = [float(block_loss(massive + e, massive, ReconLoss.MSE)) for e in (on_massive, on_ordinary)]
    tok = [float(block_loss(massive + e, massive, ReconLoss.TOKEN)) for e in (on_massive, on_ordinary)]
    assert mse[0] == mse[1]  # MSE: the same error counts the same wherever it is
    assert tok[0] == pytest.approx(1e-4 * tok[1]) and tok[1] == pytest.approx(mse[1])


def test_token_loss_reconstruction_lowers_the_error_on_images_it_never_saw(bundled, pair):
    from vizq.ptq.config import ReconLoss

    rec = calibrate(bundled, QuantConfig(**CFG, recon_iters=30, recon_loss=ReconLoss.TOKEN)).qmodel
    x = held_out(bundled)
    with torch.no_grad():
        fp = bundled.model(x).log_softmax(-1)
        kl = [float((fp.exp() * (fp - q(x).log_softmax(-1))).sum(-1).mean()) for q in (pair[0], rec)]
    assert kl[1] < kl[0], kl
    assert rec.config.to_dict()["recon_loss"] == "token"
    rec.remove_hooks()


def test_recon_loss_is_checked_and_needs_reconstruction():
    from vizq.ptq.config import ConfigError, ReconLoss

    with pytest.raises(ConfigError, match="recon_iters"):
        QuantConfig(**CFG, recon_loss=ReconLoss.TOKEN)
    cfg = QuantConfig(**CFG, recon_iters=5, recon_loss="token")  # text from a file or the CLI becomes the type
    for text in (cfg.to_yaml(), cfg.to_json()):
        back = QuantConfig.from_text(text)
        assert back.recon_loss is ReconLoss.TOKEN and back == cfg


def test_augmented_views_keep_the_images_first_and_reproduce_from_the_seed(bundled):
    from vizq.ptq.views import augmented_views

    x = calibration_batch(bundled, QuantConfig(**CFG, calibration={"images": 8}))[0]
    a, b, c = (augmented_views(x, 3, s) for s in (0, 0, 1))
    assert len(a) == 3 and all(v.shape == x.shape for v in a)
    assert torch.equal(a[0], x)  # the user's images themselves come first
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[1], c[1]) and not torch.equal(a[1], x)
    with pytest.raises(ValueError, match="batch of images"):
        augmented_views(x[0], 2, 0)


def test_recon_views_are_checked_named_and_change_the_rounding(bundled, pair):
    from vizq.ptq.config import ConfigError, options_label

    with pytest.raises(ConfigError, match="recon_iters"):
        QuantConfig(**CFG, recon_views=4)
    with pytest.raises(ConfigError, match="recon_views"):
        QuantConfig(**CFG, recon_iters=5, recon_views=0)
    cfg = QuantConfig(**CFG, recon_iters=30, recon_views=3)
    assert "3 views" in options_label(cfg.to_dict()) and QuantConfig.from_text(cfg.to_yaml()) == cfg
    rec = calibrate(bundled, cfg).qmodel
    assert any(not torch.equal(rec.fp_weights[p], pair[1].fp_weights[p]) for p in rec.recon_modules)
    x = held_out(bundled)
    with torch.no_grad():
        fp = bundled.model(x).log_softmax(-1)
        kl = [float((fp.exp() * (fp - q(x).log_softmax(-1))).sum(-1).mean()) for q in (pair[0], rec)]
    assert kl[1] < kl[0], kl  # still a reconstruction that helps on images it never saw
    rec.remove_hooks()


def test_block_tensors_stop_at_the_block_and_match_a_full_forward(bundled):
    x = calibration_batch(bundled, QuantConfig(**CFG, calibration={"images": 4}))[0]
    last = list(bundled.model.children())[-1]
    full, reached = [], []
    h = bundled.model.get_submodule("blocks.1").register_forward_hook(lambda m, a, o: full.append(o))
    tail = last.register_forward_hook(lambda m, a, o: reached.append(1))
    try:
        with torch.no_grad():
            bundled.model(x)
        assert reached == [1]
        out = _block_tensors(bundled.model, "blocks.1", x, inputs=False)
        inp = _block_tensors(bundled.model, "blocks.1", x, inputs=True)
        assert reached == [1]  # neither forward went past blocks.1
    finally:
        h.remove()
        tail.remove()
    assert torch.equal(out[0], full[0]) and inp[0].shape == full[0].shape


def test_range_images_set_the_ranges_and_reconstruction_trains_on_all(bundled):
    """With range_images = 8 of 16: every activation range is the one 8 images give, and the
    re-rounding differs from reconstructing on those 8 alone (it saw the other 8 too)."""
    from vizq.ptq.config import ConfigError, options_label

    with pytest.raises(ConfigError, match="recon_iters"):
        QuantConfig(**CFG, range_images=8, calibration={"images": 16})
    with pytest.raises(ConfigError, match="at most calibration.images"):
        QuantConfig(**CFG, recon_iters=5, range_images=32, calibration={"images": 16})
    images = calibration_batch(bundled, QuantConfig(**CFG, calibration={"images": 16}))[0]
    split = QuantConfig(**CFG, recon_iters=10, range_images=8, calibration={"images": 16})
    assert "ranges on 8" in options_label(split.to_dict()) and QuantConfig.from_text(split.to_yaml()) == split
    runs = {}
    for name, cfg, x in (("split", split, images), ("eight", QuantConfig(**CFG, recon_iters=10, calibration={"images": 8}), images[:8]),
                         ("all", QuantConfig(**CFG, recon_iters=10, calibration={"images": 16}), images)):
        runs[name] = QuantizedModel(bundled, cfg).calibrate(x)
    a, b, c = runs["split"], runs["eight"], runs["all"]
    for n, aq in a.acts.items():
        for k, v in aq.q.state.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b.acts[n].q.state[k]), (n, k)
    assert any(not torch.equal(a.acts[n].q.state[k], v) for n, aq in c.acts.items()
               for k, v in aq.q.state.items() if isinstance(v, torch.Tensor))  # 16 images give other ranges
    assert any(not torch.equal(a.fp_weights[p], b.fp_weights[p]) for p in a.recon_modules)
    for m in runs.values():
        m.remove_hooks()
