"""The timm family: ViT, DeiT and Swin by timm name, from shipped weights, the hub or a file.

Specs:
- a timm name (``deit_small_patch16_224``, tags like ``.augreg_in21k_ft_in1k`` allowed):
  weights shipped in ``assets/`` first (the real ViT-Ti, :data:`REAL_DEFAULT`), then timm's
  hub when reachable, else a fast, clear error;
- ``random:<timm name>``: random init (tests, benchmarks, structure exploration);
- ``<timm name>@<path>`` or ``load_model(name, checkpoint=path)``: a local ``.safetensors`` /
  ``.pth`` / ``.pt`` file, read with ``weights_only=True``.

It matches every spec no other family claims, so it sits last in ``vizq.families.FAMILIES``.
"""
from __future__ import annotations

import hashlib
import socket
from pathlib import Path
from typing import Any

import timm
from torch import nn

from ..data import ImageSet, folder_images, skimage_photos
from ..family import Family, LoadedModel, ModelLoadError, finish, load_state_checked, read_checkpoint

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
#: Real pretrained weights shipped in assets/ (see assets/VIT_TINY_NOTICE.md): timm name ->
#: (file, sha256). Loading the name reads the file first, the hub only when it is missing.
REAL_DEFAULT = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
BUNDLED_TIMM = {REAL_DEFAULT: (f"{REAL_DEFAULT}.safetensors",
                               "3f1f07da5e1337265ac1eb0234d13841467caf730b3c4240bd3f98c49bc16a92")}
_DEFAULT_TAGS = {"vit_tiny_patch16_224": REAL_DEFAULT}  # timm's default tag for the bare name
HUB_HOST = ("huggingface.co", 443)

#: Architectures we test against (all random-init in CI), grouped by family.
SUPPORTED_ARCHS = {
    "vit": ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224"],
    "deit": ["deit_tiny_patch16_224", "deit_small_patch16_224", "deit_base_patch16_224"],
    "swin": ["swin_tiny_patch4_window7_224", "swin_small_patch4_window7_224", "swin_base_patch4_window7_224"],
}


def family_of(arch: str) -> str:
    base = arch.split(".")[0]
    for fam, names in SUPPORTED_ARCHS.items():
        if base in names or base.startswith(fam):
            return fam
    return "vit" if "vit" in base else base.split("_")[0]


def hub_reachable(timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(HUB_HOST, timeout=timeout):
            return True
    except OSError:
        return False


def class_names(n: int) -> list[str]:
    """ImageNet-1k descriptions for a 1000-class head, else the indices."""
    if n != 1000:
        return [str(i) for i in range(n)]
    from timm.data import ImageNetInfo

    info = ImageNetInfo()
    return [info.index_to_description(i) for i in range(n)]


def imagenet_synsets() -> list[str]:
    from timm.data import ImageNetInfo

    info = ImageNetInfo()
    return [info.index_to_label_name(i) for i in range(1000)]


def open_folder(loaded: LoadedModel, path: str) -> ImageSet:
    """An ImageFolder whose synset-named class folders map through ImageNet's order."""
    synsets = imagenet_synsets() if len(loaded.class_names) == 1000 else None
    return folder_images(path, loaded.class_names, synsets)


def _split_spec(spec: str) -> tuple[str, str | None]:
    if "@" in spec:
        arch, path = spec.split("@", 1)
        return arch, path
    return spec, None


def load(spec: str, checkpoint: str | None = None, pretrained: bool | None = None, **kw: Any) -> LoadedModel:
    random_init = spec.startswith("random:")
    arch, path = _split_spec(spec.removeprefix("random:"))
    checkpoint = checkpoint or path
    base = arch.split(".")[0]
    if base not in timm.list_models():
        raise ModelLoadError(
            f"unknown model {arch!r}. Use {REAL_DEFAULT!r}, vizq-vit-tiny, a timm name such as "
            f"{', '.join(SUPPORTED_ARCHS['deit'][:2])}, or list them with `python -m vizq models`"
        )
    if pretrained is None:
        pretrained = not random_init and checkpoint is None
    fam = family_of(arch)
    shipped = _bundled_file(arch) if pretrained and not checkpoint else None
    if shipped is not None:
        model = _create(_DEFAULT_TAGS.get(arch, arch), **kw)
        load_state_checked(model, read_checkpoint(str(shipped)), shipped.name)
        return finish(model, TIMM, arch, base, fam, class_names(model.num_classes), f"bundled (assets/{shipped.name})")
    if pretrained and not checkpoint:
        if not hub_reachable():
            raise ModelLoadError(
                f"pretrained weights for {arch} come from the Hugging Face hub, which cannot be reached "
                f"from this machine. Download them where there is network and pass the file: "
                f"--model {arch}@/path/to/weights.safetensors (or load_model({arch!r}, checkpoint=...)); "
                f"or use random:{arch} to explore the structure"
            )
        try:
            model = timm.create_model(arch, pretrained=True, **kw)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"downloading pretrained weights for {arch} failed: {e}") from e
        return finish(model, TIMM, arch, arch, fam, class_names(model.num_classes), "timm-hub")
    model = _create(arch, **kw)
    if checkpoint:
        sd = read_checkpoint(checkpoint)
        filt = getattr(__import__(type(model).__module__, fromlist=["x"]), "checkpoint_filter_fn", None)
        if filt is not None:
            try:
                sd = filt(sd, model)
            except Exception:  # noqa: BLE001 - the strict check below reports the real mismatch
                pass
        load_state_checked(model, sd, Path(checkpoint).name)
        src = f"checkpoint:{Path(checkpoint).name}"
        return finish(model, TIMM, f"{base}@{Path(checkpoint).name}", base, fam, class_names(model.num_classes), src)
    return finish(model, TIMM, f"random:{base}", base, fam, class_names(model.num_classes), "random-init")


def _create(arch: str, **kw: Any) -> nn.Module:
    """timm model without weights, keeping the tag so its pretrained_cfg (preprocessing) is the
    tag's own: ``vit_tiny_patch16_224.augreg_in21k_ft_in1k`` normalises with mean = std = 0.5."""
    try:
        return timm.create_model(arch, pretrained=False, **kw)
    except RuntimeError:  # a tag timm does not know: the architecture's default configuration
        return timm.create_model(arch.split(".")[0], pretrained=False, **kw)


def _bundled_file(arch: str) -> Path | None:
    """The shipped weights for ``arch``, verified, or None when this name has none (or the
    file was removed: then the hub path applies). A file whose hash differs is an error,
    never silently used."""
    entry = BUNDLED_TIMM.get(_DEFAULT_TAGS.get(arch, arch))
    if entry is None or not (ASSETS / entry[0]).is_file():
        return None
    path = ASSETS / entry[0]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry[1]:
        raise ModelLoadError(f"assets/{path.name} is damaged (sha256 {digest[:12]}…, expected {entry[1][:12]}…); "
                             "restore it with `git checkout -- assets/`")
    return path


def rows() -> list[dict[str, str]]:
    out = [{"spec": n, "family": "vit", "weights": "bundled (assets/, real ImageNet weights)", "ready": "yes"}
           for n in BUNDLED_TIMM]
    for fam, names in SUPPORTED_ARCHS.items():
        for n in names:
            out.append({"spec": n, "family": fam, "weights": "timm hub (network) or NAME@FILE", "ready": "needs weights"})
            out.append({"spec": f"random:{n}", "family": fam, "weights": "random init", "ready": "yes"})
    return out


TIMM = Family(
    name="timm", matches=lambda spec: True, load=load, rows=rows, samples=lambda part: skimage_photos(),
    samples_label="scikit-image photographs (bundled, no labels)", open_data=open_folder,
)
