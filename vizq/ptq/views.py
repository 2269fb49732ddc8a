"""Augmented views of the calibration images, for block reconstruction only.

Why: reconstruction learns one rounding choice per weight from a few dozen images, and on the
real ViT-Ti at W4A4 it measurably overfits 32 of them (README: 128 images gave +4.8 points on
the same evaluation images). A user who has only 32 images can still show each block more
varied inputs: random crops and mirror images of the same photographs, which the float model
classifies just as well. The ranges and GPTQ's Gram matrices are not fed these views; they are
computed on the images the user chose, so only the learned rounding (and LSQ scales) see them.

The crops are drawn from a generator seeded with the calibration seed, so a run reproduces.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: crop area as a fraction of the image, and its aspect ratio range (log-uniform), as in the
#: random-resized-crop of ImageNet training but milder: calibration views should stay in the
#: distribution the model is evaluated on (centre crops of whole photographs)
AREA = (0.35, 1.0)
ASPECT = (3 / 4, 4 / 3)
FLIP = 0.5  # probability of a horizontal mirror


def _crop_box(h: int, w: int, gen: torch.Generator) -> tuple[int, int, int, int]:
    """(top, left, height, width) of one random crop of an h × w image."""
    for _ in range(10):
        area = h * w * (AREA[0] + (AREA[1] - AREA[0]) * torch.rand((), generator=gen).item())
        log_r = math.log(ASPECT[0]) + (math.log(ASPECT[1]) - math.log(ASPECT[0])) * torch.rand((), generator=gen).item()
        ch, cw = round(math.sqrt(area / math.exp(log_r))), round(math.sqrt(area * math.exp(log_r)))
        if 0 < ch <= h and 0 < cw <= w:
            top = int(torch.randint(0, h - ch + 1, (), generator=gen))
            left = int(torch.randint(0, w - cw + 1, (), generator=gen))
            return top, left, ch, cw
    return 0, 0, h, w


def augmented_views(images: torch.Tensor, views: int, seed: int) -> list[torch.Tensor]:
    """``images`` (N, C, H, W, already preprocessed) followed by ``views − 1`` batches of the
    same N images, each randomly cropped, resized back to H × W (bicubic, antialiased) and
    mirrored with probability one half. Returned as one batch per view, so no forward holds
    more images than the user's calibration batch."""
    if images.dim() != 4:
        raise ValueError(f"augmented views need a batch of images (N, C, H, W); got a tensor of shape {tuple(images.shape)}")
    gen = torch.Generator().manual_seed(seed)
    h, w = images.shape[-2:]
    out = [images]
    for _ in range(views - 1):
        batch = []
        for img in images:
            top, left, ch, cw = _crop_box(h, w, gen)
            crop = img[None, :, top:top + ch, left:left + cw]
            view = F.interpolate(crop, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
            if torch.rand((), generator=gen).item() < FLIP:
                view = view.flip(-1)
            batch.append(view[0])
        out.append(torch.stack(batch))
    return out
