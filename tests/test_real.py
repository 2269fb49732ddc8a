"""Where realism matters: the real pretrained ViT-Ti/16 and real ImageNet images.

They live in ``../shared/data`` (not part of the product); every test here skips with the reason
when that folder is absent, as on a user's fresh clone.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
IMAGES = SHARED / "imagenet-sample-500"
needs_images = pytest.mark.skipif(not IMAGES.is_dir(), reason=f"the real ImageNet sample was not found at {IMAGES}")


@pytest.fixture(scope="module")
def vit():
    """The real ViT-Ti/16 shipped in assets/, loaded by its timm name (no network, no ../shared)."""
    from vizq.models import REAL_DEFAULT, load_model

    return load_model(REAL_DEFAULT)


@pytest.fixture(scope="module")
def photos(vit):
    from vizq.data import resolve_images

    if not IMAGES.is_dir():
        pytest.skip(f"the real ImageNet sample was not found at {IMAGES}")
    return resolve_images(vit, str(IMAGES), "eval")


def _tensor(vit, photos, site_name: str, n: int = 8) -> torch.Tensor:
    from vizq.capture import site_hooks
    from vizq.sites import find_site

    site = find_site(vit.sites, site_name)
    kept = []
    with site_hooks(vit.model, [site], lambda s, x: kept.append(x.detach().clone())):
        for xb, _, _ in vit.iterate(photos, list(range(n)), n):
            vit.model(xb)
    return torch.cat(kept)


def test_the_timm_name_loads_the_bundled_weights_offline_with_the_tags_preprocessing(vit):
    from vizq.families.timm_vit import ASSETS
    from vizq.models import load_model

    assert vit.info.weights_source.startswith("bundled") and vit.info.num_blocks == 12
    cfg = vit.info.data_config  # timm's pretrained_cfg for the augreg tag, not ImageNet's mean/std
    assert cfg["interpolation"] == "bicubic" and cfg["crop_pct"] == 0.9
    assert cfg["mean"] == [0.5, 0.5, 0.5] and cfg["std"] == [0.5, 0.5, 0.5]
    same = load_model(f"vit_tiny_patch16_224@{ASSETS / 'vit_tiny_patch16_224.augreg_in21k_ft_in1k.safetensors'}")
    assert same.info.weights_sha256 == vit.info.weights_sha256
    assert load_model("vit_tiny_patch16_224").info.weights_sha256 == vit.info.weights_sha256  # the default tag


def test_a_damaged_bundled_file_is_refused_not_used(tmp_path, monkeypatch):
    from vizq import models
    from vizq.families import timm_vit

    name, _ = timm_vit.BUNDLED_TIMM[models.REAL_DEFAULT]
    data = bytearray((timm_vit.ASSETS / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / name).write_bytes(bytes(data))
    monkeypatch.setattr(timm_vit, "ASSETS", tmp_path)
    with pytest.raises(models.ModelLoadError, match="damaged"):
        models.load_model(models.REAL_DEFAULT)


@needs_images
def test_pretrained_preprocessing_decides_accuracy(vit, photos):
    """Right normalisation: ~83 % on this sample; ImageNet's mean/std: ~51 %."""
    from timm.data import create_transform

    idx = list(range(0, 500, 10))
    wrong_tf = create_transform(**{**vit.info.data_config, "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)})
    right = wrong = 0
    with torch.no_grad():
        for xb, yb, _ in vit.iterate(photos, idx, 25):
            right += int((vit.model(xb).argmax(-1) == yb).sum())
        wrong_vit = dataclasses.replace(vit, transform=wrong_tf)
        for xb, yb, _ in wrong_vit.iterate(photos, idx, 25):
            wrong += int((vit.model(xb).argmax(-1) == yb).sum())
    assert right >= 36 and wrong <= right - 8, (right, wrong)  # 50 images


def test_massive_activations_are_found_where_they_are(vit, photos):
    from vizq.massive import find_massive

    found = find_massive(vit, photos, list(range(8)), batch_size=8)
    by_site = {f.site: f for f in found}
    gelu7 = by_site["blocks.7.mlp.act"]
    assert gelu7.count > 0 and gelu7.max_abs > 50 * 1 and gelu7.max_abs / gelu7.median_abs > 1000
    assert len(gelu7.channels) <= 10  # a few channels carry them
    assert found[0].count >= gelu7.count  # sorted most massive first


def test_exact_quantiles_and_seedless_searches_on_a_real_tensor(vit, photos):
    """RepQ-ViT's percentiles are torch.quantile of the whole tensor: ours equal it to the bit
    on the tensor with the massive activations, and the search sample keeps all of them."""
    from vizq.quant.base import TAIL_KEEP, quantiles, search_sample

    x = _tensor(vit, photos, "blocks.7.mlp.act").reshape(1, -1)
    probs = [0.999, 0.9999, 0.99999, 1 - 0.999, 1 - 0.9999, 1 - 0.99999]
    ref = torch.stack([torch.quantile(x[0], p) for p in probs])
    assert torch.equal(quantiles(x, probs)[:, 0], ref)
    sample, w = search_sample(x)
    top = x.topk(TAIL_KEEP).values
    assert torch.isin(top, sample).all() and w is not None and float(w.sum()) == pytest.approx(1.0)
    assert torch.equal(search_sample(x)[0], sample)  # no seed: the same tensor, the same sample


@pytest.mark.parametrize("preset", ["repq", "ptq4vit-mse"])
def test_calibration_does_not_depend_on_any_seed_or_on_the_allocator(vit, photos, preset):
    """Two calibrations in one process, under different torch seeds, give the same state.
    ``ptq4vit-mse`` searches on tail-exact samples of 4-image tensors; before the sample cache
    checked the storage, its second calibration here differed in about half the runs (a freed
    site tensor's address reused by the next one of the same shape)."""
    from vizq.ptq.config import QuantConfig
    from vizq.ptq.engine import QuantizedModel

    calib = torch.cat([xb for xb, _, _ in vit.iterate(photos, list(range(100, 104)), 4)])
    states = []
    for seed in (0, 1234):
        torch.manual_seed(seed)
        qm = QuantizedModel(vit, QuantConfig(preset=preset, wbits=4, abits=4)).calibrate(calib)
        states.append({f"{k}/{p}": v.clone() for k, aq in qm.acts.items() for p, v in aq.q.state.items()})
        qm.remove_hooks()
    assert states[0].keys() == states[1].keys()
    assert [k for k in states[0] if not torch.equal(states[0][k], states[1][k])] == []


def test_the_range_choice_at_the_massive_site_depends_on_the_error_measured(vit, photos):
    """The finding behind repq+: at blocks.7.mlp.act the tensor's own MSE (and the plain output
    MSE) keep the massive values and round almost every ordinary value to zero; the next
    Linear's error per token prefers clipping them."""
    from vizq.massive import range_study

    x = _tensor(vit, photos, "blocks.7.mlp.act")
    rows = {r["range"]: r for r in range_study(x, vit.model.get_submodule("blocks.7.mlp.fc2").weight, 4)}
    keep, clip = rows["min/max"], rows["percentile 0.999"]
    assert keep["mse"] < clip["mse"] and keep["output_mse"] < clip["output_mse"]
    assert clip["output_rel_per_token"] * 5 < keep["output_rel_per_token"]
    assert keep["ordinary_to_zero_pct"] > 95 and clip["massive_clipped"] > 0


@needs_images
def test_token_loss_takes_the_massive_tokens_weight_off_a_late_block_output(vit, photos):
    """From block 7 on, a few tokens carry most of the residual stream's energy, so plain MSE
    reconstruction is spent on them; the token loss weighs them down to ordinary tokens' level."""
    from vizq.ptq.recon import _token_weights

    out = _tensor(vit, photos, "blocks.8")  # [8, 197, 192], the float output of block 8
    energy = out.pow(2).sum(-1)  # per token
    top = energy.flatten().topk(2 * out.shape[0]).indices  # two tokens an image
    assert float(energy.flatten()[top].sum() / energy.sum()) > 0.4  # they dominate plain MSE
    w = _token_weights(out).squeeze(-1)
    assert float(w.flatten()[top].max()) < 0.01 and 0.5 < float(w.median()) < 2
    weighted = energy * w
    assert float(weighted.flatten()[top].sum() / weighted.sum()) < 0.05  # equal-error share: each token ~1/197
