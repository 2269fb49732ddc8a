"""Capture: hooks always removed, outputs unchanged, streaming == all at once, bounded memory."""
from __future__ import annotations

import resource

import numpy as np
import pytest
import torch

from vizq.capture import Capture, capture_activations, channel_variation, hook_count, key_mass, powerlaw_tail, site_hooks
from vizq.data import resolve_images
from vizq.sites import select_sites


def test_hooks_are_removed_even_after_an_exception(bundled):
    def boom(site, x):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        with site_hooks(bundled.model, bundled.sites, boom):
            assert hook_count(bundled.model) > 0
            bundled.model(torch.randn(1, 3, 32, 32))
    assert hook_count(bundled.model) == 0


def test_capture_changes_no_output_and_leaves_no_hook(bundled, bundled_capture):
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        before = bundled.model(x)
        images = resolve_images(bundled, None, "eval")
        capture_activations(bundled, images, [0, 1, 2], batch_size=2)
        assert torch.equal(bundled.model(x), before)
    assert hook_count(bundled.model) == 0


def test_attention_rows_sum_to_one(bundled_capture):
    for i in range(6):
        p = bundled_capture.site(f"blocks.{i}.attn.softmax").sample()
        assert p.shape[1:] == (3, 65, 65)
        assert torch.allclose(p.sum(-1), torch.ones(p.shape[:-1]), atol=1e-5)


def test_streaming_statistics_equal_all_at_once(bundled):
    images = resolve_images(bundled, None, "eval")
    idx = list(range(20))
    sites = select_sites(bundled.sites, "blocks.1.*", kinds=["post_ln", "post_softmax", "post_gelu"])
    # batches of 3 (streamed) with every image kept in the reservoir (the reference tensors)
    cap = capture_activations(bundled, images, idx, sites, batch_size=3, reservoir_images=len(idx))
    for s in sites:
        st = cap.site(s.name)
        full = st.sample().double()
        assert st.moments.n == full.numel()
        assert float(st.moments.min) == float(full.min()) and float(st.moments.max) == float(full.max())
        assert np.isclose(float(st.moments.mean), float(full.mean()), rtol=1e-9, atol=1e-12)
        assert np.isclose(float(st.moments.std), float(full.std(unbiased=False)), rtol=1e-6)
        if s.kind == "post_ln":
            flat = full.reshape(-1, full.shape[-1])
            assert torch.equal(st.channel.min, flat.min(0).values) and torch.equal(st.channel.max, flat.max(0).values)
            assert torch.allclose(st.channel.mean, flat.mean(0), atol=1e-9)
            assert torch.allclose(st.channel.std, flat.std(0, unbiased=False), rtol=1e-6, atol=1e-9)
            pct = st.percentiles()
            assert torch.allclose(pct[99.9], torch.quantile(flat, 0.999, dim=0))
        elif s.kind == "post_softmax":
            from vizq.stats import log2_bin_index

            ref = torch.bincount(log2_bin_index(full).flatten(), minlength=33)
            assert torch.equal(st.log_hist.sum(dim=(0, 1)).long(), ref)
            assert int(st.log_hist[:, 0].sum()) == full[..., :1].numel()  # the CLS key column
            assert torch.allclose(key_mass(st), full.sum(dim=(1, 2)).mean(0) / (3 * 65), atol=1e-9)
        else:
            ref, _ = np.histogram(full.numpy().ravel(), bins=st.hist.edges.numpy())
            assert (ref == st.hist.counts.numpy()).all()


def test_derived_views_on_bundled(bundled_capture):
    for i in range(6):
        assert channel_variation(bundled_capture.site(f"blocks.{i}.norm1")) > 1.0
        t = powerlaw_tail(bundled_capture.site(f"blocks.{i}.attn.softmax"))
        assert t["alpha"] > 0 and 0 < t["frac_above_0.5"] < 0.1
        assert bundled_capture.site(f"blocks.{i}").absmax_where["channel"] >= 0


def test_capture_saves_and_loads(tmp_path, bundled_capture):
    bundled_capture.save(tmp_path / "s.vizq")
    back = Capture.load(tmp_path / "s.vizq")
    assert back.image_ids == bundled_capture.image_ids
    a, b = bundled_capture.site("blocks.2.norm1"), back.site("blocks.2.norm1")
    assert torch.equal(a.sample(), b.sample()) and torch.equal(a.channel.max, b.channel.max)
    assert torch.equal(bundled_capture.site("blocks.2.attn.softmax").log_hist, back.site("blocks.2.attn.softmax").log_hist)
    (tmp_path / "junk.vizq").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable vizq capture"):
        Capture.load(tmp_path / "junk.vizq")


def _state_bytes(cap: Capture) -> int:
    total = 0

    def walk(o):
        nonlocal total
        if torch.is_tensor(o):
            total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(cap.to_state())
    return total


def test_memory_is_bounded_over_320_images(bundled):
    """The capture's size does not grow with images; peak RSS growth stays under 150 MB."""
    images = resolve_images(bundled, None, "calib")
    small = capture_activations(bundled, images, list(range(64)), batch_size=64, reservoir_images=8)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    big = capture_activations(bundled, images, list(range(320)), batch_size=64, reservoir_images=8)
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert big.num_images == 320
    assert _state_bytes(big) == _state_bytes(small)
    assert growth_mb < 150, growth_mb
