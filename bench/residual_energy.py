"""Where the residual stream's squared energy sits, block by block: why the reconstruction loss
matters (``--recon-loss``, ptq/recon.py).

Block reconstruction minimises the squared error of each block's output. If a handful of values
carry most of that output's energy, plain MSE is spent on them. This prints, for each block's
float output on the calibration images an evaluation would use: the largest |value|, and the
share of the squared energy in the top 0.1 % of values, in the two largest tokens of each image,
and in the four largest channels.

Run (the README's figures under "Optional block reconstruction"):
  .venv/bin/python bench/residual_energy.py --model vit_tiny_patch16_224.augreg_in21k_ft_in1k \
      --data ../shared/data/imagenet-sample-500 --calib 32 --seed 0
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` finds vizq

import torch  # noqa: E402

from vizq.capture import site_hooks  # noqa: E402
from vizq.models import load_model  # noqa: E402
from vizq.ptq.config import QuantConfig  # noqa: E402
from vizq.ptq.evaluate import calibration_batch  # noqa: E402


def shares(out: torch.Tensor) -> tuple[float, float, float, float]:
    """max |x|; energy share of the top 0.1 % values, of the top 2 tokens an image, of the top 4 channels."""
    e = out.double().pow(2)
    total = float(e.sum())
    k = max(1, e.numel() // 1000)
    top_values = float(e.flatten().topk(k).values.sum()) / total
    tok = e.sum(-1)  # [images, tokens]
    top_tokens = float(tok.topk(2, dim=1).values.sum()) / total
    ch = e.sum((0, 1))
    top_channels = float(ch.topk(4).values.sum()) / total
    return float(out.abs().max()), top_values, top_tokens, top_channels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="vit_tiny_patch16_224.augreg_in21k_ft_in1k")
    ap.add_argument("--data", required=True)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    loaded = load_model(a.model)
    x, _ = calibration_batch(loaded, QuantConfig(preset="minmax", calibration={"images": a.calib, "seed": a.seed}), a.data)
    sites = [s for s in loaded.sites if s.kind == "residual"]
    outs: dict[str, torch.Tensor] = {}
    with torch.no_grad(), site_hooks(loaded.model, sites, lambda s, t: outs.__setitem__(s.name, t.detach().clone())):
        loaded.model(x)
    print("| block output | max abs | top 0.1 % values | top 2 tokens an image | top 4 channels |")
    print("|---|---|---|---|---|")
    for s in sites:
        m, v, t, c = shares(outs[s.name])
        print(f"| `{s.name}` | {m:.1f} | {100 * v:.1f} % | {100 * t:.1f} % | {100 * c:.1f} % |")


if __name__ == "__main__":
    main()
