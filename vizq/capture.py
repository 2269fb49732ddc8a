"""Hook into a model's sites and stream statistics over any number of images.

``site_hooks`` installs forward hooks and always removes them. ``capture_activations`` runs
images through the model and feeds each site's tensor to its accumulators:

- every activation site: overall moments, max |x| and where it sits (token, channel), and a
  reservoir of whole images' tensors (the quantizer lab works on these);
- ``post_ln`` (and ``residual``): per-channel min/max/mean/std; percentiles from the reservoir;
- ``post_softmax``: log2-binned histograms per head, split by key token (to CLS vs to
  patches), and the attention mass each key token receives (sink detection);
- everything else: a linear histogram whose range doubles as needed.

Memory is bounded by the reservoir size, whatever the number of images.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from . import atomic
from .data import ImageSet, none_readable
from .errors import Cancelled, InputError
from .memory import pin_mmap_threshold
from .sites import Site
from .stats import LOG_BINS, ImageReservoir, LinearHistogram, Moments, log2_bin_edges, log2_histogram

FORMAT_VERSION = 1
PERCENTILES = (0.1, 1.0, 99.0, 99.9)
Progress = Callable[[int, int, str], None]


# ---------------------------------------------------------------- hooks
def _module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


@contextmanager
def site_hooks(model: nn.Module, sites: Iterable[Site], fn: Callable[[Site, torch.Tensor], Any]) -> Iterator[None]:
    """Call ``fn(site, tensor)`` whenever a site's tensor is produced; hooks always removed.

    If ``fn`` returns a tensor, it replaces the site's tensor (how the PTQ engine quantizes).
    """
    handles = []
    try:
        for s in sites:
            m = _module(model, s.module)
            if s.port in ("output", "consumers"):  # consumers-port sites are observed at the output
                def out_hook(mod, args, out, s=s):  # noqa: ANN001 - torch hook signature
                    r = fn(s, out)
                    return r if torch.is_tensor(r) else None

                handles.append(m.register_forward_hook(out_hook))
            elif s.port == "input":
                def in_hook(mod, args, s=s):  # noqa: ANN001
                    r = fn(s, args[0])
                    return (r, *args[1:]) if torch.is_tensor(r) else None

                handles.append(m.register_forward_pre_hook(in_hook))
        yield
    finally:
        for h in handles:
            h.remove()


def hook_count(model: nn.Module) -> int:
    """Forward hooks currently installed anywhere in ``model`` (tests check it returns to 0)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ---------------------------------------------------------------- per-site accumulation
@dataclass
class SiteStats:
    site: Site
    moments: Moments
    channel: Moments | None = None
    hist: LinearHistogram | None = None
    log_hist: torch.Tensor | None = None  # [heads, 2 (to CLS, to patches), LOG_BINS+1]
    key_mass: torch.Tensor | None = None  # [N] summed over queries, heads and images
    key_mass_rows: torch.Tensor | None = None  # [N] how many probability rows had key position n
    absmax: float = 0.0
    absmax_where: dict[str, Any] = field(default_factory=dict)
    reservoir: list[torch.Tensor | None] = field(default_factory=list)  # whole-image tensors

    def sample(self) -> torch.Tensor:
        """The reservoir's images concatenated on dim 0 (what the quantizer lab uses)."""
        kept = [t for t in self.reservoir if t is not None]
        if not kept:
            raise InputError(f"no tensors were kept for {self.site.name}")
        if all(t.shape == kept[0].shape for t in kept):
            return torch.cat(kept, 0)
        return _ragged_cat(kept, self.site.kind == "post_softmax")

    def percentiles(self) -> dict[float, torch.Tensor]:
        """Per-channel percentiles of the reservoir's values (exact when all images were kept)."""
        x = self.sample().reshape(-1, self.sample().shape[-1]).double()
        q = torch.tensor([p / 100 for p in PERCENTILES], dtype=torch.float64)
        vals = torch.quantile(x, q, dim=0)
        return {p: vals[i] for i, p in enumerate(PERCENTILES)}


def _ragged_cat(kept: list[torch.Tensor], probabilities: bool) -> torch.Tensor:
    """Sentences of different lengths as one sample: tokens concatenated (dim -2), and
    attention matrices placed block-diagonally so each row still sums to 1 and P·V stays
    per sentence."""
    if not probabilities:
        return torch.cat(kept, -2)
    lead = kept[0].shape[1:-2]
    n = sum(t.shape[-1] for t in kept)
    out = torch.zeros(1, *lead, n, n, dtype=kept[0].dtype)
    o = 0
    for t in kept:
        size = t.shape[-1]
        out[0, ..., o : o + size, o : o + size] = t[0]
        o += size
    return out


def _update(st: SiteStats, x: torch.Tensor, prefix_tokens: int) -> None:
    x = x.detach().float()
    st.moments.update(x)
    if st.channel is not None:
        st.channel.update(x)
    a = x.abs()
    m = float(a.max())
    if m > st.absmax:
        st.absmax = m
        flat = int(a.argmax())
        idx = list(torch.unravel_index(torch.tensor(flat), a.shape))
        st.absmax_where = {"channel": int(idx[-1]), "token": int(idx[-2]) if x.dim() >= 3 else -1, "value": float(x.flatten()[flat])}
    if st.site.kind == "post_softmax":
        b, h, n, _ = x.shape
        key_is_cls = torch.zeros(n, dtype=torch.long)
        if prefix_tokens:
            key_is_cls[:prefix_tokens] = 0
            key_is_cls[prefix_tokens:] = 1
        else:
            key_is_cls[:] = 1
        groups = torch.arange(h).view(1, h, 1, 1) * 2 + key_is_cls.view(1, 1, 1, n)
        hist = log2_histogram(x, groups.expand_as(x), 2 * h).reshape(h, 2, LOG_BINS + 1)
        st.log_hist = hist if st.log_hist is None else st.log_hist + hist
        mass = x.double().sum(dim=(0, 1, 2))  # [N] summed over images, heads and queries
        rows = torch.full((n,), float(b * h * n), dtype=torch.float64)
        st.key_mass = _add_padded(st.key_mass, mass)  # text: sequence lengths differ per batch
        st.key_mass_rows = _add_padded(st.key_mass_rows, rows)
    elif st.hist is not None:
        st.hist.update(x)


def _add_padded(acc: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
    if acc is None:
        return v.clone()
    n = max(acc.numel(), v.numel())
    return torch.nn.functional.pad(acc, (0, n - acc.numel())) + torch.nn.functional.pad(v, (0, n - v.numel()))


def _new_stats(site: Site, x: torch.Tensor) -> SiteStats:
    per_channel = site.kind in ("post_ln", "residual")
    return SiteStats(
        site=site,
        moments=Moments(),
        channel=Moments(x.shape[-1]) if per_channel else None,
        hist=None if site.kind == "post_softmax" else LinearHistogram(),
    )


# ---------------------------------------------------------------- capture
@dataclass
class Capture:
    """Everything captured for one model and image set; saved to and loaded from one file."""

    model_id: str
    weights_sha256: str
    image_ids: list[str]
    stats: dict[str, SiteStats]
    num_prefix_tokens: int = 1
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)
    reservoir_ids: list[str] = field(default_factory=list)  # image id of each reservoir slot

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    def site(self, name: str) -> SiteStats:
        if name not in self.stats:
            raise InputError(f"site {name!r} was not captured; captured sites: {', '.join(list(self.stats)[:8])} …")
        return self.stats[name]

    def save(self, path: str | Path) -> None:
        atomic_torch_save(self.to_state(), path)

    def to_state(self) -> dict[str, Any]:
        sites = {}
        for name, st in self.stats.items():
            s = st.site
            sites[name] = {
                "site": {"name": s.name, "kind": s.kind, "module": s.module, "port": s.port,
                         "consumers": list(s.consumers), "block": -1 if s.block is None else s.block},
                "moments": st.moments.state(),
                "channel": st.channel.state() if st.channel else None,
                "hist": st.hist.state() if st.hist else None,
                "log_hist": st.log_hist,
                "key_mass": st.key_mass,
                "key_mass_rows": st.key_mass_rows,
                "absmax": st.absmax,
                "absmax_where": st.absmax_where,
                "reservoir": [t for t in st.reservoir if t is not None],
            }
        return {"format": "vizq-capture", "version": FORMAT_VERSION, "model_id": self.model_id,
                "weights_sha256": self.weights_sha256, "image_ids": self.image_ids, "sites": sites,
                "num_prefix_tokens": self.num_prefix_tokens, "seconds": self.seconds, "skipped": self.skipped,
                "reservoir_ids": self.reservoir_ids}

    @classmethod
    def load(cls, path: str | Path) -> "Capture":
        p = Path(path)
        if not p.is_file():
            raise InputError(f"capture file {str(p)!r} does not exist; create it with `python -m vizq capture`")
        try:
            d = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise InputError(f"{p.name} is not a readable vizq capture: {e}") from e
        if not isinstance(d, dict) or d.get("format") != "vizq-capture":
            raise InputError(f"{p.name} is not a vizq capture file")
        if d["version"] > FORMAT_VERSION:
            raise InputError(f"{p.name} was written by a newer vizq (format {d['version']}); upgrade vizq")
        return cls.from_state(d)

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> "Capture":
        stats = {}
        for name, s in d["sites"].items():
            si = s["site"]
            site = Site(si["name"], si["kind"], si["module"], si["port"], tuple(si["consumers"]),
                        None if si["block"] < 0 else si["block"])
            stats[name] = SiteStats(
                site=site,
                moments=Moments.from_state(s["moments"]),
                channel=Moments.from_state(s["channel"]) if s["channel"] else None,
                hist=LinearHistogram.from_state(s["hist"]) if s["hist"] else None,
                log_hist=s["log_hist"], key_mass=s["key_mass"], key_mass_rows=s["key_mass_rows"],
                absmax=s["absmax"], absmax_where=s["absmax_where"], reservoir=list(s["reservoir"]),
            )
        return cls(d["model_id"], d["weights_sha256"], d["image_ids"], stats, d["num_prefix_tokens"], d["seconds"],
                   d["skipped"], list(d.get("reservoir_ids", [])))


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """Serialize in memory, then write with Python's I/O: a full disk is then an ``OSError``
    with its errno (torch's own writer reports it as a bare RuntimeError)."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic.write_bytes(path, buf.getvalue())


@torch.no_grad()
def capture_activations(
    loaded: Any,
    images: ImageSet,
    indices: Sequence[int] | None = None,
    sites: Sequence[Site] | None = None,
    batch_size: int = 32,
    reservoir_images: int = 8,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
) -> Capture:
    """Stream ``images`` through ``loaded.model`` and accumulate statistics for ``sites``.

    ``loaded`` is a :class:`vizq.models.LoadedModel`. The model's outputs are unchanged (hooks
    only read). ``cancel()`` returning True stops the run with :class:`Cancelled`.
    """
    pin_mmap_threshold()
    model = loaded.model
    sites = [s for s in (sites if sites is not None else loaded.sites) if s.is_activation]
    if not sites:
        raise InputError("no activation sites selected; check the --sites glob or kinds")
    indices = list(range(len(images))) if indices is None else list(indices)
    if not indices:
        raise InputError("no images to capture; pass at least one image")
    stats: dict[str, SiteStats] = {}
    res = ImageReservoir(reservoir_images, seed)
    slots: list[tuple[int, int]] = []
    prefix = loaded.info.num_prefix_tokens
    ids: list[str] = []
    reservoir_ids: list[str] = [""] * reservoir_images
    batch_n = 0

    def on_tensor(site: Site, x: torch.Tensor) -> None:
        x = x.detach().cpu()
        st = stats.get(site.name)
        if st is None:
            st = stats[site.name] = _new_stats(site, x)
            st.reservoir = [None] * reservoir_images
        _update(st, x, prefix)
        per_image = x.shape[0] // batch_n if batch_n else 0  # Swin windows: several rows per image
        for i, slot in slots:
            st.reservoir[slot] = x[i * per_image : (i + 1) * per_image].clone()

    model.to(device)
    t0 = time.time()
    total = len(indices)
    with site_hooks(model, sites, on_tensor):
        for xb, _, bid in loaded.iterate(images, indices, batch_size):
            if cancel and cancel():
                raise Cancelled("capture cancelled; nothing was written")
            batch_n = xb.shape[0]
            slots = res.slots(batch_n)
            for i, slot in slots:
                reservoir_ids[slot] = bid[i]
            model(xb.to(device))
            ids.extend(bid)
            if progress:
                done = len(ids) + len(images.skipped)
                eta = (time.time() - t0) / max(done, 1) * (total - done)
                progress(done, total, f"{done}/{total} images, ETA {eta:.0f}s")
    if not ids:
        raise none_readable(images, total)
    return Capture(loaded.info.model_id, loaded.info.weights_sha256, ids, stats, prefix, time.time() - t0,
                   list(images.skipped), [r for r in reservoir_ids if r])





# ---------------------------------------------------------------- derived views
def channel_variation(st: SiteStats) -> float:
    """Inter-channel variation: max / median of per-channel ranges (max - min)."""
    if st.channel is None:
        raise InputError(f"{st.site.name} has no per-channel statistics")
    rng = (st.channel.max - st.channel.min).float()
    return float(rng.max() / rng.median().clamp_min(1e-12))


def powerlaw_tail(st: SiteStats, lo: float = 2.0**-12, hi: float = 0.5) -> dict[str, float]:
    """Fit log CCDF = -α·log x + c on the log2-binned histogram between ``lo`` and ``hi``.

    Returns α (the tail exponent; larger = lighter tail), the fit's intercept ``log10_c`` (so
    the drawn line is the fitted one), the fitted range, and the fraction of probabilities above
    0.5 and above 0.1 (bin-exact at 0.5; 0.1 falls in the [1/16, 1/8) bin, counted from 1/8).
    """
    if st.log_hist is None:
        raise InputError(f"{st.site.name} is not a post-Softmax site")
    counts = st.log_hist.sum(dim=(0, 1))  # [LOG_BINS+1]
    total = float(counts.sum())
    edges = log2_bin_edges()  # lower edge of bin i (i>=1) is edges[i-1]
    ccdf = torch.flip(torch.cumsum(torch.flip(counts[1:], [0]), 0), [0]) / total  # P(X >= lower edge i)
    x = edges[:-1]
    mask = (x >= lo) & (x <= hi) & (ccdf > 0)
    fracs = {"frac_above_0.5": float(counts[-1] / total), "frac_above_0.125": float(counts[-3:].sum() / total),
             "fit_lo": lo, "fit_hi": hi}
    if mask.sum() < 2:
        return {"alpha": float("nan"), "log10_c": float("nan"), **fracs}
    lx, ly = torch.log10(x[mask]).double(), torch.log10(ccdf[mask]).double()
    slope = float(((lx - lx.mean()) * (ly - ly.mean())).sum() / ((lx - lx.mean()) ** 2).sum())
    return {"alpha": -slope, "log10_c": float(ly.mean() - slope * lx.mean()), **fracs}


def key_mass(st: SiteStats) -> torch.Tensor:
    """Mean attention mass each key token receives per query (1/N when uniform)."""
    if st.key_mass is None:
        raise InputError(f"{st.site.name} is not a post-Softmax site")
    return st.key_mass / st.key_mass_rows.clamp_min(1)


def summary_rows(cap: Capture) -> list[dict[str, Any]]:
    """One row per site: kind, min, max, mean, std, and the view that matters for its kind."""
    rows = []
    for name, st in cap.stats.items():
        m = st.moments
        row = {"site": name, "kind": st.site.kind, "min": float(m.min), "max": float(m.max),
               "mean": float(m.mean), "std": float(m.std), "absmax": st.absmax}
        if st.channel is not None:
            row["channel_variation"] = channel_variation(st)
        if st.site.kind == "post_softmax":
            t = powerlaw_tail(st)
            row["tail_alpha"] = t["alpha"]
            row["frac_p>0.5"] = t["frac_above_0.5"]
            km = key_mass(st)
            row["sink_token"] = int(km.argmax())
            row["sink_mass"] = float(km.max())
        rows.append(row)
    return rows
