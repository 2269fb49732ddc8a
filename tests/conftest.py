"""Shared fixtures: the bundled model and small random-init timm models (loaded once)."""
from __future__ import annotations

import os

import pytest
import torch

# test.sh runs two pytest workers (pytest-xdist) on this 2-core class of machine: one torch
# thread each keeps them from fighting over the cores; a single process uses both.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# Shallow on purpose: what these check (every site kind, every preset, folds, exports) repeats per
# block, so 4 DeiT blocks and 2 Swin blocks per stage (a shifted window in each stage that has
# room for one) test the same code as the full depth at a third of the time.
SMALL = {
    "deit": ("random:deit_tiny_patch16_224", {"img_size": 64, "depth": 4}),
    "swin": ("random:swin_tiny_patch4_window7_224", {"img_size": 64, "window_size": 4, "depths": (2, 2, 2, 2)}),
}


@pytest.fixture(scope="session")
def bundled():
    from vizq.models import load_model

    return load_model("vizq-vit-tiny")


@pytest.fixture(scope="session")
def bundled_capture(bundled):
    from vizq.capture import capture_activations
    from vizq.data import resolve_images

    images = resolve_images(bundled, None, "eval")
    return capture_activations(bundled, images, list(range(16)), batch_size=16, reservoir_images=16)


@pytest.fixture(scope="session", params=list(SMALL))
def small_model(request):
    from vizq.models import load_model

    torch.manual_seed(0)
    spec, kw = SMALL[request.param]
    return load_model(spec, **kw)


def random_images(loaded, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *loaded.info.input_size, generator=g)
