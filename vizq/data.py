"""Images in, batches out: labeled ImageFolders, flat folders, bundled sets, uploads.

A source is a list of :class:`ImageRecord` (an id, a way to open the image, an optional
label in the model's class indices). Files that are empty, truncated or not images are
skipped when opened, counted and named (``ImageSet.skipped``), never fatal.
"""
from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from .errors import VizqError

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".jpe"}
SYNSET = re.compile(r"^n\d{8}$")


class DataError(VizqError, ValueError):
    """Unusable data spec (missing or empty folder, classes that do not fit the model)."""


@dataclass
class ImageRecord:
    id: str
    open: Callable[[], Image.Image]
    label: int | None = None


@dataclass
class ImageSet:
    """Records plus what was learned while reading them."""

    name: str
    records: list[ImageRecord]
    labeled: bool
    skipped: list[str] = field(default_factory=list)  # "id: reason"

    def __len__(self) -> int:
        return len(self.records)


# ---------------------------------------------------------------- folders
def _file_opener(path: Path) -> Callable[[], Image.Image]:
    def _open() -> Image.Image:
        if path.stat().st_size == 0:
            raise OSError("zero-byte file")
        with Image.open(path) as im:
            im.load()
            return im.copy()

    return _open


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTS)


def folder_images(path: str | Path, class_names: Sequence[str] | None = None,
                  synsets: Sequence[str] | None = None) -> ImageSet:
    """A labeled ImageFolder (class sub-folders) or a flat folder of images.

    Labels: synset-named folders (``n01440764``) map through ``synsets`` (ImageNet order);
    otherwise folder names that equal the model's class names map by name; otherwise, if the
    number of folders equals the number of classes, by sorted order (torchvision's rule).
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"image folder {str(root)!r} does not exist; pass a folder of images or class sub-folders")
    if not root.is_dir():
        raise DataError(f"{str(root)!r} is a file; pass the folder that holds the images")
    subdirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    class_dirs = [d for d in subdirs if any(True for _ in d.iterdir())]
    flat = _image_files(root)
    if class_dirs and not flat:
        mapping = _label_map([d.name for d in class_dirs], class_names, synsets)
        recs = []
        for d in class_dirs:
            for f in _image_files(d):
                recs.append(ImageRecord(f"{d.name}/{f.name}", _file_opener(f), mapping[d.name]))
        if not recs:
            raise DataError(f"no image files ({', '.join(sorted(IMAGE_EXTS))}) under the class folders of {root}")
        return ImageSet(root.name, recs, labeled=True)
    if not flat:
        raise DataError(f"{str(root)!r} holds no images ({', '.join(sorted(IMAGE_EXTS))})")
    return ImageSet(root.name, [ImageRecord(f.name, _file_opener(f)) for f in flat], labeled=False)


def _label_map(folders: list[str], class_names: Sequence[str] | None, synsets: Sequence[str] | None) -> dict[str, int]:
    if synsets and all(SYNSET.match(f) for f in folders):
        index = {s: i for i, s in enumerate(synsets)}
        unknown = [f for f in folders if f not in index]
        if unknown:
            raise DataError(f"synset folder(s) {unknown[:3]} are not ImageNet-1k classes of this model")
        return {f: index[f] for f in folders}
    if class_names:
        by_name = {str(c): i for i, c in enumerate(class_names)}
        if all(f in by_name for f in folders):
            return {f: by_name[f] for f in folders}
        if len(folders) == len(class_names):
            return {f: i for i, f in enumerate(sorted(folders))}
    n = len(class_names) if class_names else "?"
    raise DataError(
        f"class folders {folders[:3]}… do not match the model head ({n} classes): name them by ImageNet "
        "synset (n01440764 …) or by the model's class names, or pass a flat folder for label-free evaluation"
    )


# ---------------------------------------------------------------- in-memory sources
def array_images(name: str, arrays: Sequence[np.ndarray], labels: Sequence[int] | None, ids: Sequence[str]) -> ImageSet:
    def opener(a: np.ndarray) -> Callable[[], Image.Image]:
        return lambda: Image.fromarray(a)

    recs = [ImageRecord(i, opener(a), None if labels is None else int(labels[k])) for k, (i, a) in enumerate(zip(ids, arrays))]
    return ImageSet(name, recs, labeled=labels is not None)


def uploaded_images(files: Sequence[tuple[str, bytes]]) -> ImageSet:
    """Images uploaded in the dashboard: (file name, bytes)."""
    def opener(data: bytes) -> Callable[[], Image.Image]:
        def _open() -> Image.Image:
            if not data:
                raise OSError("zero-byte file")
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                return im.copy()

        return _open

    if not files:
        raise DataError("no files were uploaded")
    return ImageSet("uploads", [ImageRecord(n, opener(b)) for n, b in files], labeled=False)


SKIMAGE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "coins", "moon", "page", "text",
                  "clock", "horse", "hubble_deep_field", "immunohistochemistry", "retina", "colorwheel", "cat", "logo")


def skimage_photos() -> ImageSet:
    """The natural photographs that ship inside scikit-image (no download)."""
    import skimage.data as skd

    arrays, ids = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in SKIMAGE_PHOTOS:
            fn = getattr(skd, n, None)
            if fn is None:
                continue
            try:
                a = np.asarray(fn())
            except Exception:  # noqa: BLE001 - some need a download; skip those
                continue
            if a.dtype == bool:
                a = a.astype(np.uint8) * 255
            arrays.append(a.astype(np.uint8))
            ids.append(f"skimage:{n}")
    return array_images("skimage photos", arrays, None, ids)


# ---------------------------------------------------------------- selection and batches
def split_indices(n: int, n_calib: int, n_eval: int | None, seed: int = 0) -> tuple[list[int], list[int]]:
    """Seeded, disjoint calibration and evaluation index lists (eval=None: all the rest)."""
    if n_calib < 0 or (n_eval is not None and n_eval < 0):
        raise DataError("image counts must be >= 0")
    if n_calib > n:
        raise DataError(f"asked for {n_calib} calibration images but the source has only {n}")
    perm = np.random.default_rng(seed).permutation(n).tolist()
    calib = perm[:n_calib]
    rest = perm[n_calib:]
    return calib, rest if n_eval is None else rest[:n_eval]


def pick(n: int, k: int, seed: int = 0) -> list[int]:
    """A seeded subset of k of n indices (all of them when k >= n), in source order."""
    if k >= n:
        return list(range(n))
    return sorted(np.random.default_rng(seed).choice(n, size=k, replace=False).tolist())


def to_rgb_like(im: Image.Image, channels: int) -> Image.Image:
    """Any PIL mode (L, P, RGBA, I;16, CMYK …) to what the model expects."""
    if im.mode in ("I;16", "I;16B", "I", "F"):
        a = np.asarray(im, dtype=np.float32)
        a = (255 * (a - a.min()) / max(float(a.max() - a.min()), 1e-6)).astype(np.uint8)
        im = Image.fromarray(a)
    return im.convert("L" if channels == 1 else "RGB")


def iterate_batches(images: ImageSet, indices: Sequence[int], transform: Callable[[Any], torch.Tensor],
                    batch_size: int, channels: int = 3) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, list[str]]]:
    """Yield (images, labels or None, ids); unreadable files are recorded in ``images.skipped``."""
    if batch_size < 1:
        raise DataError("batch size must be >= 1")
    xs: list[torch.Tensor] = []
    ys: list[int] = []
    ids: list[str] = []
    for i in indices:
        rec = images.records[i]
        try:
            im = to_rgb_like(rec.open(), channels)
            xs.append(transform(im))
        except DECODE_ERRORS as e:
            images.skipped.append(f"{rec.id}: {decode_reason(e)}")
            continue
        ys.append(-1 if rec.label is None else rec.label)
        ids.append(rec.id)
        if len(xs) == batch_size:
            yield (*_stack(xs, ys, images.labeled), ids)
            xs, ys, ids = [], [], []
    if xs:
        yield (*_stack(xs, ys, images.labeled), ids)


#: Everything a broken, hostile or unsupported file can raise while it is decoded and
#: transformed (PIL raises its own types, ValueError, SyntaxError, struct/zlib errors, and
#: ``DecompressionBombError`` for images over its pixel limit). One bad file must never end a
#: run, so any Exception counts; KeyboardInterrupt and MemoryError still propagate.
DECODE_ERRORS: tuple[type[BaseException], ...] = (Exception,)


def decode_reason(e: BaseException) -> str:
    """A short reason for a skipped file."""
    if isinstance(e, Image.DecompressionBombError):
        return "image too large (decompression-bomb limit of PIL)"
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:160]


def none_readable(images: ImageSet, total: int, what: str = "images") -> DataError:
    """The error for a run in which not one of ``total`` files could be read: names the first
    few and why, so the user can see whether it is the folder, the format or the files."""
    shown = "; ".join(images.skipped[:3]) or "no file was tried"
    more = f" (+{len(images.skipped) - 3} more)" if len(images.skipped) > 3 else ""
    return DataError(f"none of the {total} {what} could be read: {shown}{more}")


def _stack(xs: list[torch.Tensor], ys: list[int], labeled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.stack(xs), (torch.tensor(ys) if labeled else None)


def warn_skipped(images: ImageSet) -> str | None:
    """One warning line naming skipped files, or None."""
    if not images.skipped:
        return None
    shown = "; ".join(images.skipped[:5])
    more = f" (+{len(images.skipped) - 5} more)" if len(images.skipped) > 5 else ""
    return f"skipped {len(images.skipped)} unreadable file(s): {shown}{more}"


# ---------------------------------------------------------------- one entry point
def resolve_images(loaded: Any, data: str | None = None, part: str = "eval") -> ImageSet:
    """The samples to use for ``loaded`` (a LoadedModel): the user's folder or file, read by the
    model's family, or the family's own samples.

    ``part`` is 'calib' or 'eval': families whose samples have a training split (the digits)
    calibrate on it and evaluate on the held-out split, so the two never overlap. For a user's
    data the caller splits indices with :func:`split_indices`.
    """
    if part not in ("calib", "eval"):
        raise DataError(f"part must be 'calib' or 'eval', got {part!r}")
    if data and data != "bundled":
        return loaded.family.open(loaded, data)
    return loaded.family.samples(part)


def as_seen(im: Image.Image, transform: Callable[[Any], torch.Tensor], mean: Sequence[float],
            std: Sequence[float]) -> np.ndarray:
    """The image exactly as the model sees it (its resize and centre crop), as uint8 HWC: what
    an overlay on the patch grid must be drawn on, or patches and pixels do not line up."""
    t = transform(to_rgb_like(im, len(mean)))
    t = t * torch.tensor(std).view(-1, 1, 1) + torch.tensor(mean).view(-1, 1, 1)
    return (t.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
