"""What the charts claim, checked on real captured tensors of the bundled model."""
from __future__ import annotations

import math

import numpy as np
import torch

from vizq import plots
from vizq.capture import powerlaw_tail
from vizq.quant import get_quantizer


def test_ccdf_power_law_is_the_fitted_line_on_its_range_and_a_probability(bundled_capture):
    for name, st in bundled_capture.stats.items():
        if st.site.kind != "post_softmax":
            continue
        tail = powerlaw_tail(st)
        _, df = plots.ccdf_loglog(st.log_hist, tail)
        fit = df.dropna(subset=["fit"])
        assert len(fit) >= 2, name
        assert fit.fit.max() <= 1.0 and (df.ccdf <= 1.0 + 1e-12).all(), name
        assert fit.x.min() >= tail["fit_lo"] and fit.x.max() <= tail["fit_hi"], name
        # the drawn line is the least-squares fit: its slope on the log-log axes is -alpha
        slope = np.polyfit(np.log10(fit.x), np.log10(fit.fit), 1)[0]
        assert math.isclose(slope, -tail["alpha"], rel_tol=1e-6), name


def test_levels_axis_spans_the_data_not_a_log_grids_smallest_level(bundled_capture):
    name = next(n for n, s in bundled_capture.stats.items() if s.site.kind == "post_softmax")
    x = bundled_capture.site(name).sample()
    q = get_quantizer("log2", 8).calibrate(x)
    lv = q.levels()
    assert float(lv[lv > 0].min()) < 1e-15  # an 8-bit log2 grid reaches far below any probability here
    fig, _ = plots.levels_over_histogram(x, {"log2 8b": lv}, log_x=True)
    lo, hi = fig.layout.xaxis.range
    assert lo >= math.log10(float(x[x > 0].min())) - 1.01 and hi <= math.log10(float(x.max())) + 0.31
    assert "outside the data's range" in fig.data[1].name


def test_history_chart_never_joins_different_weight_bits_or_data():
    runs = [{"preset": "repq", "wbits": w, "abits": a, "q_top1": 50.0 + a, "agreement": 90.0, "kl": 0.1,
             "fp_top1": 80.0, "data": {"key": key}}
            for w in (4, 8) for a in (4, 6, 8) for key in ("bundled", "folder:/x")]
    fig, _ = plots.accuracy_vs_bits(runs, "q_top1")
    names = sorted(t.name for t in fig.data)
    assert len(names) == 4 and all(("W4" in n or "W8" in n) for n in names)
    assert any("folder:/x" in n for n in names)
    for t in fig.data:
        assert len(t.x) == 3 and all(s.startswith("W") and "A" in s for s in t.text)


def test_model_view_of_an_image_matches_the_patch_grid(bundled):
    """The overlay is drawn on the image as the model sees it (resize + crop): its size is the
    model's input, so patch (r, c) covers the pixels it was computed from."""
    from PIL import Image

    from vizq.data import as_seen

    dc = bundled.info.data_config
    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8))
    pic = as_seen(im, bundled.transform, dc["mean"], dc["std"])
    assert pic.shape[:2] == tuple(bundled.info.input_size[1:])
    back = torch.from_numpy(pic).permute(2, 0, 1).float() / 255
    t = bundled.transform(im.convert("RGB"))
    mean, std = torch.tensor(dc["mean"]).view(-1, 1, 1), torch.tensor(dc["std"]).view(-1, 1, 1)
    assert torch.allclose((back - mean) / std, t, atol=1 / 255 / min(dc["std"]) + 1e-6)
