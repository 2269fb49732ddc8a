"""Model loading: bundled, timm names, checkpoints, errors; the site taxonomy."""
from __future__ import annotations

import time

import pytest
import timm
import torch
from safetensors.torch import save_file
from conftest import SMALL

from vizq.models import SUPPORTED_ARCHS, ModelLoadError, load_model
from vizq.sites import KINDS, select_sites


def test_bundled_model_loads_in_eval_mode_with_metadata(bundled):
    info = bundled.info
    assert not bundled.model.training
    assert info.family == "vit" and info.weights_source == "bundled"
    assert info.input_size == (3, 32, 32) and info.patch_grid == (8, 8) and info.num_blocks == 6
    assert len(info.weights_sha256) == 64
    assert bundled.class_names == [str(i) for i in range(10)]
    assert all(not getattr(m, "fused_attn", False) for m in bundled.model.modules())


def test_bundled_model_is_accurate_on_heldout_digits(bundled):
    from vizq.families.digits import card
    from vizq.data import iterate_batches, resolve_images

    images = resolve_images(bundled, None, "eval")
    correct = n = 0
    with torch.no_grad():
        for x, y, _ in iterate_batches(images, range(len(images)), bundled.transform, 250):
            correct += int((bundled.model(x).argmax(-1) == y).sum())
            n += len(y)
    acc = 100 * correct / n
    assert n == 1000 and acc >= 95.0
    assert abs(acc - card()["heldout_top1"]) < 0.5  # the card states what the shipped weights do


def test_instrumented_attention_matches_timm(small_model):
    """Taps and the unfused forward change no output (against timm's own fused model)."""
    arch = small_model.info.arch
    _, kw = next(v for v in SMALL.values() if v[0] == f"random:{arch}")
    ref = timm.create_model(arch, pretrained=False, **kw).eval()
    ref.load_state_dict(small_model.model.state_dict())
    x = torch.randn(2, *small_model.info.input_size)
    with torch.no_grad():
        assert torch.allclose(small_model.model(x), ref(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", [a for names in SUPPORTED_ARCHS.values() for a in names])
def test_every_listed_architecture_has_every_site_kind(arch):
    kw = {"img_size": 64, "window_size": 4} if "swin" in arch else {"img_size": 32}
    lm = load_model(f"random:{arch}", **kw)
    kinds = {s.kind for s in lm.sites}
    assert kinds == set(KINDS), set(KINDS) - kinds
    names = [s.name for s in lm.sites]
    assert len(names) == len(set(names))
    if "swin" in arch:
        merging = [s for s in lm.sites if s.kind == "post_ln" and s.name.endswith("downsample.norm")]
        assert len(merging) == 3 and all(s.consumers[0].endswith("reduction") for s in merging)


def test_site_selection_by_glob_and_kind(bundled):
    soft = select_sites(bundled.sites, "blocks.*.attn.softmax")
    assert [s.name for s in soft] == [f"blocks.{i}.attn.softmax" for i in range(6)]
    assert all(s.kind == "post_softmax" for s in soft)
    ln = select_sites(bundled.sites, kinds=["post_ln"])
    assert len(ln) == 12
    both = select_sites(bundled.sites, "blocks.0.*", kinds=["post_ln", "post_gelu"])
    assert [s.name for s in both] == ["blocks.0.norm1", "blocks.0.norm2", "blocks.0.mlp.act"]
    with pytest.raises(ValueError, match="unknown site kind"):
        select_sites(bundled.sites, kinds=["post_relu"])


def test_pretrained_without_network_fails_fast_and_says_what_to_do():
    t0 = time.time()
    with pytest.raises(ModelLoadError) as e:
        load_model("deit_tiny_patch16_224.fb_in1k")
    assert time.time() - t0 < 15
    assert "cannot be reached" in str(e.value) and "@/path/to/weights.safetensors" in str(e.value)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="unknown model 'vit_gigantic'"):
        load_model("vit_gigantic")


def test_local_checkpoints_round_trip(tmp_path):
    src = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32).eval()
    sd = src.state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "w.safetensors"))
    torch.save({"model": sd}, tmp_path / "w.pth")
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        ref = src(x)
        for f in ("w.safetensors", "w.pth"):
            lm = load_model(f"deit_tiny_patch16_224@{tmp_path / f}", img_size=32)
            assert lm.info.weights_source == f"checkpoint:{f}"
            assert torch.allclose(lm.model(x), ref, atol=1e-5)


def test_mismatching_checkpoint_names_the_keys(tmp_path):
    sd = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32).state_dict()
    sd["blocks.0.attn.qkv.weight"] = torch.zeros(10, 10)
    del sd["blocks.1.norm1.bias"]
    sd["extra.thing"] = torch.zeros(1)
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(ModelLoadError) as e:
        load_model("deit_tiny_patch16_224", checkpoint=str(tmp_path / "bad.pt"), img_size=32)
    msg = str(e.value)
    assert "blocks.0.attn.qkv.weight" in msg and "blocks.1.norm1.bias" in msg and "extra.thing" in msg


def test_unsafe_pickle_is_refused(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "evil.pth").write_bytes(pickle.dumps({"x": Evil()}))
    with pytest.raises(ModelLoadError, match="weights_only"):
        load_model("deit_tiny_patch16_224", checkpoint=str(tmp_path / "evil.pth"), img_size=32)
