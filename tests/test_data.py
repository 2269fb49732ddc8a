"""Image sources: folders, synset mapping, bad files, splits."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vizq.data import DataError, folder_images, iterate_batches, resolve_images, split_indices, warn_skipped


def _img(path, mode="RGB", size=(40, 30)):
    a = (np.random.default_rng(0).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    Image.fromarray(a).convert(mode).save(path)


def test_flat_folder_with_bad_files_counts_and_names_them(tmp_path, bundled):
    _img(tmp_path / "a.png")
    _img(tmp_path / "b.jpg", "L")
    _img(tmp_path / "c.webp", "RGBA", (300, 120))
    _img(tmp_path / "d.bmp", "P")
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "notes.png").write_text("not an image")
    good = tmp_path / "trunc.jpg"
    _img(good, size=(200, 200))
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 3])
    images = folder_images(tmp_path)
    assert not images.labeled and len(images) == 7
    batches = list(iterate_batches(images, range(len(images)), bundled.transform, 3))
    got = sum(x.shape[0] for x, _, _ in batches)
    assert got == 4
    assert all(x.shape[1:] == (3, 32, 32) for x, _, _ in batches)
    assert len(images.skipped) == 3
    msg = warn_skipped(images)
    assert "empty.jpg" in msg and "notes.png" in msg and "trunc.jpg" in msg


def test_imagenet_layout_maps_synsets_to_class_indices(tmp_path):
    from vizq.families.timm_vit import imagenet_synsets

    syn = imagenet_synsets()
    for s in (syn[0], syn[207], syn[999]):
        (tmp_path / s).mkdir()
        _img(tmp_path / s / "x.JPEG")
    images = folder_images(tmp_path, [str(i) for i in range(1000)], syn)
    assert images.labeled and sorted(r.label for r in images.records) == [0, 207, 999]


def test_folder_classes_matching_head_by_name(tmp_path, bundled):
    for c in ("3", "7"):
        (tmp_path / c).mkdir()
        _img(tmp_path / c / "x.png")
    images = resolve_images(bundled, str(tmp_path))
    assert sorted(r.label for r in images.records) == [3, 7]


def test_folder_classes_that_do_not_fit_the_head(tmp_path, bundled):
    for c in ("cat", "dog"):
        (tmp_path / c).mkdir()
        _img(tmp_path / c / "x.png")
    with pytest.raises(DataError, match="do not match the model head"):
        resolve_images(bundled, str(tmp_path))


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        folder_images(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no images"):
        folder_images(tmp_path / "empty")


def test_calibration_and_evaluation_never_overlap():
    cal, ev = split_indices(100, 32, None, seed=3)
    assert len(cal) == 32 and len(ev) == 68 and not set(cal) & set(ev)
    assert split_indices(100, 32, 10, seed=3) == (cal, ev[:10])
    assert split_indices(100, 32, 10, seed=4)[0] != cal
    with pytest.raises(DataError):
        split_indices(10, 32, None)


def test_bundled_digits_split_is_disjoint(bundled):
    cal = {r.id for r in resolve_images(bundled, None, "calib").records}
    ev = {r.id for r in resolve_images(bundled, None, "eval").records}
    assert len(ev) == 1000 and len(cal) == 4000 and not cal & ev


def test_skimage_photos_for_imagenet_models():
    from vizq.data import skimage_photos

    photos = skimage_photos()
    assert len(photos) >= 8 and not photos.labeled
