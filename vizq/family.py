"""What a model family provides (:class:`Family`) and what every load returns (:class:`LoadedModel`).

A family is one record: how to recognise a spec, how to load it, which attention modules it taps
and which site rules name its tensors, which samples it brings, how it opens a user's data and
how it lists itself. ``vizq.families`` holds the explicit list; ``vizq.models`` walks it. The
core (``data``, ``sites``, ``arch``, this module) never imports a family, so adding one touches
no other file than that list.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from .arch import instrument
from .data import ImageSet, folder_images, iterate_batches, uploaded_images
from .errors import VizqError
from .sites import Rule, Site, discover_sites

Batches = Iterator[tuple[torch.Tensor, "torch.Tensor | None", list[str]]]


class ModelLoadError(VizqError, RuntimeError):
    """The model could not be loaded; the message says why and what to pass instead."""


@dataclass(frozen=True)
class Family:
    """One model family, as a plugin record (see the module docstring)."""

    name: str
    matches: Callable[[str], bool]  # does this family load ``spec``?
    load: Callable[..., "LoadedModel"]  # (spec, **kwargs) -> LoadedModel
    rows: Callable[[], list[dict[str, str]]]  # what ``vizq models`` lists for it
    samples: Callable[[str], ImageSet]  # its own samples; part is 'calib' or 'eval'
    samples_label: str  # what the dashboard calls those samples
    modality: str = "image"
    own_split: bool = False  # its samples have disjoint calibration/evaluation parts
    takes_checkpoint: bool = True  # a user checkpoint may replace its weights
    instrumenters: tuple[Callable[[nn.Module], int], ...] = ()  # attention taps beyond timm's
    site_rules: tuple[Rule, ...] = ()  # site names beyond the ViT/Swin rules
    open_data: Callable[["LoadedModel", str], ImageSet] | None = None  # a user's folder/file
    read_uploads: Callable[[Sequence[tuple[str, bytes]]], ImageSet] = uploaded_images  # dashboard uploads

    def open(self, loaded: "LoadedModel", path: str) -> ImageSet:
        """The user's data at ``path``, read the way this family reads data."""
        if self.open_data is not None:
            return self.open_data(loaded, path)
        return folder_images(path, loaded.class_names)

    def open_uploads(self, loaded: "LoadedModel", files: Sequence[tuple[str, bytes]]) -> ImageSet:
        """Files uploaded in the dashboard, read as this family's samples."""
        return self.read_uploads(files)


@dataclass
class ModelInfo:
    """What the dashboard and exports need to know about a loaded model."""

    model_id: str
    family: str
    arch: str
    input_size: tuple[int, int, int]
    patch_grid: tuple[int, int]
    num_blocks: int
    num_params: int
    num_classes: int
    num_prefix_tokens: int
    weights_source: str
    weights_sha256: str
    modality: str = "image"
    data_config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedModel:
    """An instrumented model in eval mode with its preprocessing, sites and family record."""

    model: nn.Module
    transform: Callable[[Any], Any]  # image preprocessing, or the tokenizer for text models
    class_names: list[str]
    info: ModelInfo
    sites: list[Site]
    family: Family
    batches: Callable[[ImageSet, Sequence[int], int], Batches] | None = None

    @property
    def model_id(self) -> str:
        return self.info.model_id

    def iterate(self, samples: ImageSet, indices: Sequence[int], batch_size: int) -> Batches:
        """Model-ready batches ``(inputs, labels or None, ids)`` of ``samples[indices]``."""
        if self.batches is not None:
            return self.batches(samples, indices, batch_size)
        return iterate_batches(samples, indices, self.transform, batch_size, self.info.input_size[0])


def state_dict_sha256(model: nn.Module) -> str:
    """Hash of the weights themselves (names, shapes, bytes): identifies a model across files."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(str(tuple(v.shape)).encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """A flat state dict from .safetensors or .pth/.pt/.bin (``weights_only=True``)."""
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"checkpoint {str(p)!r} does not exist; pass the path of a .safetensors or .pth file")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd: Any = load_file(str(p))
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader error becomes one clear message
        raise ModelLoadError(
            f"could not read checkpoint {p.name}: {e}. Only tensors are loaded (weights_only=True); "
            "re-save it with torch.save(model.state_dict()) or as .safetensors"
        ) from e
    for key in ("model_ema", "state_dict_ema", "model", "state_dict", "module"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
        raise ModelLoadError(f"{p.name} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def load_state_checked(model: nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """Load ``sd`` strictly; a mismatch names the first offending keys."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}" for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append("shape mismatch: " + "; ".join(shapes[:3]))
        if missing:
            parts.append(f"missing {len(missing)} key(s), first: {', '.join(missing[:3])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s), first: {', '.join(unexpected[:3])}")
        raise ModelLoadError(
            f"checkpoint {source} does not fit {type(model).__name__}: " + " | ".join(parts)
            + ". Check that the architecture name matches the checkpoint."
        )
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=True)


def prepare(model: nn.Module, family: Family) -> list[Site]:
    """Eval mode, frozen, attention tapped with the family's instrumenters; its sites."""
    model.eval()
    instrument(model, family.instrumenters)
    for p in model.parameters():
        p.requires_grad_(False)
    return discover_sites(model, family.site_rules)


def finish(model: nn.Module, family: Family, model_id: str, arch: str, arch_family: str, class_names: list[str],
           source: str, sha: str | None = None, data_config: dict | None = None) -> LoadedModel:
    """An image model ready for vizq: instrumented, its preprocessing resolved (timm's
    pretrained_cfg unless ``data_config`` is given), its metadata gathered."""
    from timm.data import create_transform, resolve_data_config

    sites = prepare(model, family)
    cfg = data_config or resolve_data_config({}, model=model)
    img = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if img is not None and tuple(cfg["input_size"][1:]) != tuple(img):  # built with img_size=…
        cfg = {**cfg, "input_size": (cfg["input_size"][0], *img)}
    pe = getattr(model, "patch_embed", None)
    info = ModelInfo(
        model_id=model_id,
        family=arch_family,
        arch=arch,
        input_size=tuple(cfg["input_size"]),
        patch_grid=tuple(getattr(pe, "grid_size", (0, 0))),
        num_blocks=sum(1 for s in sites if s.kind == "residual"),
        num_params=sum(p.numel() for p in model.parameters()),
        num_classes=getattr(model, "num_classes", len(class_names)),
        num_prefix_tokens=int(getattr(model, "num_prefix_tokens", 0)),
        weights_source=source,
        weights_sha256=sha or state_dict_sha256(model),
        data_config={k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
    )
    return LoadedModel(model, create_transform(**cfg, is_training=False), class_names, info, sites, family)


def rows_of(families: Iterable[Family]) -> list[dict[str, str]]:
    return [r for f in families for r in f.rows()]
