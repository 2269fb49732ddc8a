"""One door to every model: ``load_model(spec)``.

Specs:
- ``vizq-vit-tiny``: the bundled ViT trained on MNIST digits (weights under ``assets/``);
- a timm name (``deit_small_patch16_224``, tags like ``.augreg_in21k_ft_in1k`` allowed):
  pretrained weights from timm's hub when reachable, else a fast, clear error;
- ``random:<timm name>``: random init (tests, benchmarks, structure exploration);
- ``<timm name>@<path>`` or ``load_model(name, checkpoint=path)``: a local ``.safetensors`` /
  ``.pth`` / ``.pt`` file, read with ``weights_only=True``.

Every model comes back in eval mode, instrumented (unfused attention with taps), with its
preprocessing, class names and metadata. Loaders are a registry (``LOADERS``) keyed by the
first matching predicate, so a new family plugs in without touching the others.
"""
from __future__ import annotations

import hashlib
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import timm
import torch
from timm.data import create_transform, resolve_data_config
from torch import nn

from .arch import instrument
from .errors import VizqError
from .sites import Site, discover_sites

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED = "vizq-vit-tiny"
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


class ModelLoadError(VizqError, RuntimeError):
    """The model could not be loaded; the message says why and what to pass instead."""


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
    model: nn.Module
    transform: Callable[[Any], Any]  # image preprocessing, or the tokenizer for text models
    class_names: list[str]
    info: ModelInfo
    sites: list[Site]
    batches: Callable[..., Any] | None = None  # (samples, indices, batch_size) -> batches

    @property
    def model_id(self) -> str:
        return self.info.model_id

    def iterate(self, samples: Any, indices: Any, batch_size: int) -> Any:
        """Model-ready batches ``(inputs, labels or None, ids)`` of ``samples[indices]``."""
        if self.batches is not None:
            return self.batches(samples, indices, batch_size)
        from .data import iterate_batches

        return iterate_batches(samples, indices, self.transform, batch_size, self.info.input_size[0])


# ---------------------------------------------------------------- helpers
def family_of(arch: str) -> str:
    base = arch.split(".")[0]
    for fam, names in SUPPORTED_ARCHS.items():
        if base in names or base.startswith(fam):
            return fam
    return "vit" if "vit" in base else base.split("_")[0]


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


def hub_reachable(timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(HUB_HOST, timeout=timeout):
            return True
    except OSError:
        return False


def _imagenet_class_names(n: int) -> list[str]:
    if n != 1000:
        return [str(i) for i in range(n)]
    from timm.data import ImageNetInfo

    info = ImageNetInfo()
    return [info.index_to_description(i) for i in range(n)]


def imagenet_synsets() -> list[str]:
    from timm.data import ImageNetInfo

    info = ImageNetInfo()
    return [info.index_to_label_name(i) for i in range(1000)]


def finish(model: nn.Module, model_id: str, arch: str, family: str, class_names: list[str], source: str,
           sha: str | None = None, data_config: dict | None = None) -> LoadedModel:
    """Eval mode, instrument, resolve preprocessing, gather metadata."""
    model.eval()
    instrument(model)
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = data_config or resolve_data_config({}, model=model)
    img = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if img is not None and tuple(cfg["input_size"][1:]) != tuple(img):  # built with img_size=…
        cfg = {**cfg, "input_size": (cfg["input_size"][0], *img)}
    transform = create_transform(**cfg, is_training=False)
    pe = getattr(model, "patch_embed", None)
    grid = tuple(getattr(pe, "grid_size", (0, 0)))
    sites = discover_sites(model)
    info = ModelInfo(
        model_id=model_id,
        family=family,
        arch=arch,
        input_size=tuple(cfg["input_size"]),
        patch_grid=grid,
        num_blocks=sum(1 for s in sites if s.kind == "residual"),
        num_params=sum(p.numel() for p in model.parameters()),
        num_classes=getattr(model, "num_classes", len(class_names)),
        num_prefix_tokens=int(getattr(model, "num_prefix_tokens", 0)),
        weights_source=source,
        weights_sha256=sha or state_dict_sha256(model),
        data_config={k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
    )
    return LoadedModel(model, transform, class_names, info, sites)


# ---------------------------------------------------------------- loaders
def _load_bundled(spec: str, **kw: Any) -> LoadedModel:
    from .bundled import load_bundled

    return load_bundled(**kw)


def _split_spec(spec: str) -> tuple[str, str | None]:
    if "@" in spec:
        arch, path = spec.split("@", 1)
        return arch, path
    return spec, None


def _load_timm(spec: str, checkpoint: str | None = None, pretrained: bool | None = None, **kw: Any) -> LoadedModel:
    random_init = spec.startswith("random:")
    arch, path = _split_spec(spec.removeprefix("random:"))
    checkpoint = checkpoint or path
    base = arch.split(".")[0]
    if base not in timm.list_models():
        raise ModelLoadError(
            f"unknown model {arch!r}. Use {BUNDLED!r}, a timm name such as "
            f"{', '.join(SUPPORTED_ARCHS['deit'][:2])}, or list them with `python -m vizq models`"
        )
    if pretrained is None:
        pretrained = not random_init and checkpoint is None
    fam = family_of(arch)
    bundled = _bundled_file(arch) if pretrained and not checkpoint else None
    if bundled is not None:
        model = _create(_DEFAULT_TAGS.get(arch, arch), **kw)
        load_state_checked(model, read_checkpoint(str(bundled)), bundled.name)
        return finish(model, arch, base, fam, _imagenet_class_names(model.num_classes), f"bundled (assets/{bundled.name})")
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
        return finish(model, arch, arch, fam, _imagenet_class_names(model.num_classes), "timm-hub")
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
        return finish(model, f"{base}@{Path(checkpoint).name}", base, fam, _imagenet_class_names(model.num_classes), src)
    return finish(model, f"random:{base}", base, fam, _imagenet_class_names(model.num_classes), "random-init")


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


#: (predicate on spec, loader). First match wins; vizq.text registers the text family.
LOADERS: list[tuple[Callable[[str], bool], Callable[..., LoadedModel]]] = [
    (lambda s: s == BUNDLED, _load_bundled),
]


def load_model(spec: str, **kwargs: Any) -> LoadedModel:
    """Load ``spec`` (see module docstring). Extra kwargs go to the family loader
    (for timm: ``checkpoint=``, ``pretrained=``, ``img_size=`` and other create_model args)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"model spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    from . import text  # noqa: F401 - registers the text family's loader
    for pred, loader in LOADERS:
        if pred(spec):
            if kwargs.get("checkpoint"):  # these bring their own weights: never ignore a checkpoint silently
                raise ModelLoadError(f"{spec} brings its own weights and takes no checkpoint; pass a timm architecture "
                                     f"(e.g. --model vit_tiny_patch16_224 --checkpoint FILE) or drop --checkpoint")
            return loader(spec, **kwargs)
    return _load_timm(spec, **kwargs)


def list_models() -> list[dict[str, str]]:
    """What can be loaded here and what needs weights first."""
    rows = [{"spec": BUNDLED, "family": "vit", "weights": "bundled (assets/, digits)", "ready": "yes"}]
    rows += [{"spec": n, "family": "vit", "weights": "bundled (assets/, real ImageNet weights)", "ready": "yes"}
             for n in BUNDLED_TIMM]
    for fam, names in SUPPORTED_ARCHS.items():
        for n in names:
            rows.append({"spec": n, "family": fam, "weights": "timm hub (network) or NAME@FILE", "ready": "needs weights"})
            rows.append({"spec": f"random:{n}", "family": fam, "weights": "random init", "ready": "yes"})
    for extra in EXTRA_MODEL_ROWS:
        rows.append(extra)
    return rows


#: Rows other families add to ``list_models`` (see vizq.text).
EXTRA_MODEL_ROWS: list[dict[str, str]] = []
