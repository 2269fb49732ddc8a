"""Evaluate a quantized model against full precision in one pass, and rank sensitivity.

Per batch both models run on the same images: top-1/top-5 where labels exist, label-free
agreement (quantized top-1 == FP top-1), mean KL(FP ‖ quantized) of the output
distributions, and two SQNRs per site. ``site_sqnr_db`` compares the quantized model's tensor with the
FP model's at the same site, so it carries every upstream error: late sites read low even when
their own quantizer is fine. ``quantizer_sqnr_db`` compares each quantizer's output with the very
tensor it was handed in that pass, its own rounding alone. The first says where the network has
drifted, the second which quantizer is coarse; reading one as the other blames the wrong site.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ..capture import site_hooks
from ..data import DataError, ImageSet, none_readable, pick, split_indices
from ..dataspec import DataSpec
from ..device import describe
from ..dist import Context, broadcast_object, gather_objects, shard, sum_tensor
from ..family import LoadedModel
from ..errors import Cancelled, InputError
from ..quant import native
from .config import QuantConfig
from .engine import QuantizedModel

Progress = Callable[[int, int, str], None]


@dataclass
class EvalResult:
    model: str
    preset: str
    wbits: int
    abits: int
    calib_images: int
    eval_images: int
    fp_top1: float | None
    q_top1: float | None
    fp_top5: float | None
    q_top5: float | None
    agreement: float
    kl: float | None
    seconds_calibrate: float
    seconds_eval: float
    site_sqnr_db: dict[str, float] = field(default_factory=dict)  # against FP at the site: accumulated error
    quantizer_sqnr_db: dict[str, float] = field(default_factory=dict)  # each quantizer on its own input
    skipped_images: int = 0  # calibration and evaluation files that could not be read
    skipped_files: list[str] = field(default_factory=list)  # "id: reason", calibration ones first
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # family-specific (text: cosine, recall@10)
    fake_quant_kernel: str = ""  # "compiled" (vizq's CPU kernel) or "torch": explains seconds_eval
    data: dict[str, Any] = field(default_factory=dict)  # DataSpec.record(): which samples were used
    machine: dict[str, Any] = field(default_factory=dict)  # device.describe(): where it was computed

    def to_dict(self, per_site: bool = True) -> dict[str, Any]:
        """Everything; ``per_site=False`` leaves out the two per-site SQNR tables (one value per
        site each), which the run history does not keep."""
        d = asdict(self)
        if not per_site:
            del d["site_sqnr_db"], d["quantizer_sqnr_db"]
        return d


class _Acc:
    def __init__(self) -> None:
        self.n = 0
        self.labeled = 0
        self.fp1 = self.q1 = self.fp5 = self.q5 = 0
        self.agree = 0
        self.kl = 0.0
        self.site = _Sums()  # quantized tensor against the FP model's (accumulated error)
        self.own = _Sums()  # each quantizer's output against its own input (its rounding alone)

    def update(self, fp: torch.Tensor, q: torch.Tensor, y: torch.Tensor | None) -> None:
        self.n += fp.shape[0]
        self.agree += int((fp.argmax(-1) == q.argmax(-1)).sum())
        lp, lq = torch.log_softmax(fp.double(), -1), torch.log_softmax(q.double(), -1)
        self.kl += float((lp.exp() * (lp - lq)).sum())
        if y is not None:
            k = min(5, fp.shape[-1])
            self.labeled += y.shape[0]
            for logits, top1, top5 in ((fp, "fp1", "fp5"), (q, "q1", "q5")):
                tk = logits.topk(k, -1).indices
                setattr(self, top1, getattr(self, top1) + int((tk[:, 0] == y).sum()))
                setattr(self, top5, getattr(self, top5) + int((tk == y[:, None]).any(-1).sum()))

    def pct(self, v: int) -> float | None:
        return 100.0 * v / self.labeled if self.labeled else None

    def reduce(self, ctx: Context) -> None:
        """Sum every count and error over the ranks (identity for one process): the result
        equals a single-process run on all images (counts exactly, float sums to rounding)."""
        if not ctx.active:
            return
        ints = sum_tensor(torch.tensor([self.n, self.labeled, self.fp1, self.q1, self.fp5, self.q5, self.agree],
                                       dtype=torch.int64), ctx).tolist()
        self.n, self.labeled, self.fp1, self.q1, self.fp5, self.q5, self.agree = ints
        self.kl = float(sum_tensor(torch.tensor([self.kl], dtype=torch.float64), ctx))
        self.site.reduce(ctx)
        self.own.reduce(ctx)


class _Sums:
    """Per-site sums of signal and error energy (float64), reducible over ranks."""

    def __init__(self) -> None:
        self.signal: dict[str, float] = {}
        self.noise: dict[str, float] = {}

    def add(self, name: str, ref: torch.Tensor, x: torch.Tensor) -> None:
        r = ref.detach().double()
        self.signal[name] = self.signal.get(name, 0.0) + float(r.pow(2).sum())
        self.noise[name] = self.noise.get(name, 0.0) + float((r - x.detach().double()).pow(2).sum())

    def reduce(self, ctx: Context) -> None:
        names = sorted(set().union(*gather_objects(sorted(self.noise), ctx)))
        floats = sum_tensor(torch.tensor([self.signal.get(k, 0.0) for k in names]
                                         + [self.noise.get(k, 0.0) for k in names], dtype=torch.float64), ctx).tolist()
        self.signal = dict(zip(names, floats[:len(names)]))
        self.noise = dict(zip(names, floats[len(names):]))

    def db(self) -> dict[str, float]:
        return {k: (math.inf if n == 0 else 10 * math.log10(max(self.signal[k], 1e-30) / n)) for k, n in self.noise.items()}


def _fold_factors(loaded: LoadedModel, qmodel: QuantizedModel, site: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(r, δ) where the quantized model carries ``site`` as x / r − δ (RepQ-ViT's fold), in float64.

    A fold into the LayerNorm is read back from the two LayerNorms (γ' = γ / r, β' = β / r − δ),
    so a model restored from an export or sent from rank 0, which keeps no factors, is measured
    exactly as the freshly calibrated one; a consumer-side fold keeps its factors on the quantizer."""
    if site.name not in qmodel.folds:
        return None
    aq = qmodel.acts[site.name]
    if aq.ratio is not None:  # consumer-side: the quantizer's output is folded, the LayerNorm's is not
        return None if site.port == "consumers" else (aq.ratio.double(), aq.delta.double())
    fp, q = loaded.model.get_submodule(site.module), qmodel.model.get_submodule(site.module)
    gq = q.weight.detach().double()
    r = torch.where(gq == 0, torch.ones_like(gq), fp.weight.detach().double() / gq)
    return r, fp.bias.detach().double() / r - q.bias.detach().double()


@contextmanager
def _metered(qmodel: QuantizedModel, meter: Callable[[str, torch.Tensor, torch.Tensor], None] | None) -> Iterator[None]:
    """Attach ``meter`` to the model's quantizers for one pass and detach it however the pass
    ends (a cancel must not leave it counting)."""
    qmodel.meter = meter
    try:
        yield
    finally:
        qmodel.meter = None


@torch.no_grad()
def evaluate(loaded: LoadedModel, qmodel: QuantizedModel, images: ImageSet, indices: Sequence[int], batch_size: int = 32,
             device: str | torch.device = "cpu", site_sqnr: bool = True, progress: Progress | None = None,
             cancel: Callable[[], bool] | None = None, calib_images: int = 0, seconds_calibrate: float = 0.0,
             ctx: Context | None = None) -> EvalResult:
    """Both models on the same images. Under torchrun (``ctx``) each rank takes its shard of
    ``indices`` and the sums are all-reduced, so every rank returns the full result."""
    ctx = ctx or Context()
    total_all = len(indices)
    indices = shard(indices, ctx)
    fp_model = loaded.model.to(device)
    qmodel.to(device)
    acc = _Acc()
    watch = [s for s in loaded.sites if s.is_activation and (s.name in qmodel.acts or s.kind == "residual")] if site_sqnr else []
    fp_tensors: dict[str, torch.Tensor] = {}

    def keep_fp(site: Any, x: torch.Tensor) -> None:
        fp_tensors[site.name] = x.detach()

    def compare_q(site: Any, x: torch.Tensor) -> None:
        ref = fp_tensors.get(site.name)
        if ref is None or ref.shape != x.shape:
            return
        if site.name in folded:  # compare like with like, or a folded site reads as a 7 dB error at 8 bits
            r, d = folded[site.name]
            ref = ref.double() / r.to(ref.device) - d.to(ref.device)
        acc.site.add(site.name, ref, x)

    folded = {s.name: f for s in watch if (f := _fold_factors(loaded, qmodel, s)) is not None}
    t0 = time.time()
    total = len(indices)
    if progress:
        progress(0, total, "")
    with site_hooks(fp_model, watch, keep_fp), site_hooks(qmodel.model, watch, compare_q), \
            _metered(qmodel, acc.own.add if site_sqnr else None):
        for xb, yb, _ in loaded.iterate(images, indices, batch_size):
            if cancel and cancel():
                raise Cancelled("evaluation cancelled; no result was written")
            xb = xb.to(device)
            fp_tensors.clear()
            fp = fp_model(xb).float().cpu()
            q = qmodel(xb).float().cpu()
            acc.update(fp, q, yb)
            if progress:
                progress(acc.n + len(images.skipped), total, f"agreement {100 * acc.agree / max(acc.n, 1):.1f}%")
    acc.reduce(ctx)
    skipped = [s for part in gather_objects(list(images.skipped), ctx) for s in part]
    if acc.n == 0:
        images.skipped[:] = skipped
        raise none_readable(images, total_all, "evaluation images")
    cfg = qmodel.config
    return EvalResult(
        model=loaded.info.model_id, preset=cfg.preset, wbits=cfg.wbits, abits=cfg.abits,
        calib_images=calib_images, eval_images=acc.n,
        fp_top1=acc.pct(acc.fp1), q_top1=acc.pct(acc.q1), fp_top5=acc.pct(acc.fp5), q_top5=acc.pct(acc.q5),
        agreement=100.0 * acc.agree / acc.n, kl=acc.kl / acc.n,
        seconds_calibrate=seconds_calibrate, seconds_eval=time.time() - t0,
        site_sqnr_db=acc.site.db(), quantizer_sqnr_db=acc.own.db(), skipped_images=len(skipped), skipped_files=skipped, config=cfg.to_dict(),
        fake_quant_kernel=native.kernel_for(device), machine=describe(device),
    )


@torch.no_grad()
def evaluate_embeddings(loaded: LoadedModel, qmodel: QuantizedModel, texts: ImageSet, indices: Sequence[int],
                        batch_size: int = 64, device: str | torch.device = "cpu", site_sqnr: bool = True,
                        progress: Progress | None = None, cancel: Callable[[], bool] | None = None,
                        calib_images: int = 0, seconds_calibrate: float = 0.0, ctx: Context | None = None) -> EvalResult:
    """Label-free evaluation of a sentence encoder: mean cosine(FP, Q) of the embeddings and
    nearest-neighbour retrieval agreement among the evaluated sentences (top-1 neighbour the
    same; recall@10 of the FP top-10 neighbours in the quantized top-10)."""
    fp_model = loaded.model.to(device)
    qmodel.to(device)
    ctx = ctx or Context()
    fps, qs = [], []
    t0 = time.time()
    total = len(indices)
    if progress:
        progress(0, total, "")
    for xb, _, _ in loaded.iterate(texts, shard(indices, ctx), batch_size):
        if cancel and cancel():
            raise Cancelled("evaluation cancelled; no result was written")
        xb = xb.to(device)
        fps.append(fp_model(xb).float().cpu())
        qs.append(qmodel(xb).float().cpu())
        if progress:
            progress(sum(len(f) for f in fps), total, "")
    parts = gather_objects((fps, qs), ctx)  # neighbours are searched among all sentences: gather them
    fps, qs = [f for p in parts for f in p[0]], [q for p in parts for q in p[1]]
    if not fps:
        raise none_readable(texts, total, "evaluation sentences")
    fp, q = torch.cat(fps), torch.cat(qs)
    m = retrieval_metrics(fp, q)
    cfg = qmodel.config
    return EvalResult(
        model=loaded.info.model_id, preset=cfg.preset, wbits=cfg.wbits, abits=cfg.abits,
        calib_images=calib_images, eval_images=len(fp), fp_top1=None, q_top1=None, fp_top5=None, q_top5=None,
        agreement=m["nn_top1_agreement"], kl=None, seconds_calibrate=seconds_calibrate, seconds_eval=time.time() - t0,
        skipped_images=0, config=cfg.to_dict(), metrics=m, fake_quant_kernel=native.kernel_for(device),
        machine=describe(device),
    )


def retrieval_metrics(fp: torch.Tensor, q: torch.Tensor, k: int = 10) -> dict[str, float]:
    """Cosine between paired embeddings and neighbour agreement (self excluded), in percent."""
    fp = torch.nn.functional.normalize(fp.double(), dim=-1)
    q = torch.nn.functional.normalize(q.double(), dim=-1)
    cos = (fp * q).sum(-1)
    n = fp.shape[0]
    k = min(k, n - 1)
    eye = torch.eye(n, dtype=torch.bool)
    sf = (fp @ fp.T).masked_fill(eye, -2)
    sq = (q @ q.T).masked_fill(eye, -2)
    tf, tq = sf.topk(k, -1).indices, sq.topk(k, -1).indices
    top1 = (tf[:, 0] == tq[:, 0]).double().mean()
    recall = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(tf, tq)]).mean()
    return {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
            "nn_top1_agreement": 100 * float(top1), f"recall_at_{k}": 100 * float(recall)}


def calibration_batch(loaded: LoadedModel, config: QuantConfig, data: DataSpec | str | None = None,
                      skipped: list[str] | None = None, for_eval: bool = True) -> tuple[Any, list[str]]:
    """The seeded calibration samples, and their ids (for the manifest): one tensor for
    images, a list of equal-length batches for text. Files that could not be read are
    appended to ``skipped`` ("id: reason"); the ids are those really used. ``for_eval``: the
    same pool must also supply evaluation images (see :func:`calib_count`); an export that
    only calibrates takes the count asked."""
    cal = config.calibration
    spec = DataSpec.of(data)
    images = spec.open(loaded, "calib")
    if spec.own_split(loaded):
        idx = pick(len(images), cal.images, cal.seed)
    else:
        n = calib_count(len(images), cal.images) if for_eval else min(cal.images, len(images))
        idx, _ = split_indices(len(images), n, 0, cal.seed)
    xs, ids = [], []
    for xb, _, bid in loaded.iterate(images, idx, cal.batch_size):
        xs.append(xb)
        ids.extend(bid)
    if skipped is not None:
        skipped.extend(images.skipped)
    if not xs:
        raise none_readable(images, len(idx), "calibration images")
    if loaded.info.modality == "text":
        return xs, ids
    return torch.cat(xs), ids


def eval_split(loaded: LoadedModel, config: QuantConfig, data: DataSpec | str | None, n_eval: int,
               seed: int = 0) -> tuple[ImageSet, list[int]]:
    """Evaluation images, disjoint from calibration (held-out split, or the pool's remainder)."""
    spec = DataSpec.of(data)
    images = spec.open(loaded, "eval")
    if spec.own_split(loaded):
        idx = pick(len(images), n_eval, seed)
    else:
        _, idx = split_indices(len(images), calib_count(len(images), config.calibration.images), n_eval,
                               config.calibration.seed)
    if not idx:
        raise DataError(f"no images are left for evaluation after the {config.calibration.images} calibration images; "
                         "use fewer calibration images or more data")
    return images, idx


def calib_count(pool: int, asked: int) -> int:
    """Calibration images taken from a pool that also supplies the evaluation images: as asked,
    but never more than half the pool, so a small set (the 17 bundled photographs, a few
    uploads) still leaves images to evaluate on; results report the counts really used."""
    return min(asked, max(1, pool // 2))


@dataclass
class Calibration:
    """A calibrated model and what it was calibrated on (for manifests and honest reports)."""

    qmodel: QuantizedModel
    image_ids: list[str]
    skipped: list[str]
    seconds: float


def calibrate(loaded: LoadedModel, config: QuantConfig, data: DataSpec | str | None = None, device: str | torch.device = "cpu",
              progress: Progress | None = None, cancel: Callable[[], bool] | None = None,
              for_eval: bool = True, recon_progress: Progress | None = None) -> Calibration:
    """Calibrate ``config`` on the seeded calibration samples of ``data``; the one way every
    caller (CLI, pages, evaluation) builds a calibrated model, so all use the same data."""
    t0 = time.time()
    skipped: list[str] = []
    calib, ids = calibration_batch(loaded, config, data, skipped, for_eval)
    qmodel = QuantizedModel(loaded, config)
    qmodel.calib_ids = ids
    loaded.model.to(device)
    qmodel.to(device)
    calib = [c.to(device) for c in calib] if isinstance(calib, list) else calib.to(device)
    qmodel.calibrate(calib, progress=progress, cancel=cancel, recon_progress=recon_progress)
    return Calibration(qmodel, ids, skipped, time.time() - t0)


def calibrate_shared(loaded: LoadedModel, config: QuantConfig, data: DataSpec | str | None, ctx: Context,
                     progress: Progress | None = None, cancel: Callable[[], bool] | None = None,
                     for_eval: bool = True, recon_progress: Progress | None = None) -> Calibration:
    """Under torchrun: rank 0 calibrates and sends the calibrated state to every rank.

    One calibration rather than one per rank: it is the single source of truth (GPU kernels
    need not be bit-identical across ranks), it costs the other ranks nothing but the
    transfer, and the state is small (scales, zero points, folded weights)."""
    from .export import restore, snapshot

    if not ctx.active:
        return calibrate(loaded, config, data, ctx.device, progress, cancel, for_eval, recon_progress)
    cal = calibrate(loaded, config, data, ctx.device, progress, cancel, for_eval, recon_progress) if ctx.main else None
    payload = broadcast_object(
        (snapshot(cal.qmodel, cal.image_ids), cal.image_ids, cal.skipped, cal.seconds) if cal else None, ctx)
    if cal is not None:
        return cal
    (tensors, sites, man), ids, skipped, seconds = payload
    qm = restore(loaded, config, tensors, sites, man).to(ctx.device)
    return Calibration(qm, ids, skipped, seconds)


def run_eval(loaded: LoadedModel, config: QuantConfig, data: DataSpec | str | None = None, n_eval: int = 1000, device: str = "cpu",
             batch_size: int = 64, progress: Progress | None = None, cancel: Callable[[], bool] | None = None,
             qmodel: QuantizedModel | None = None, ctx: Context | None = None,
             calib_progress: Progress | None = None,
             recon_progress: Progress | None = None, site_sqnr: bool = True) -> tuple[EvalResult, QuantizedModel]:
    """Calibrate (unless ``qmodel`` is given, e.g. reloaded from an export) and evaluate;
    under torchrun (``ctx``) calibration is shared from rank 0 and evaluation is sharded.
    ``calib_progress`` and ``progress`` report the two phases separately (sites, then images).
    ``site_sqnr=False`` skips the per-site SQNR (a float64 pass over every site's tensor in
    both models): for sweeps that only need the end metrics."""
    ctx = ctx or Context(device=str(device))
    n_cal, t_cal, skipped = 0, 0.0, []
    if qmodel is None:
        cal = calibrate_shared(loaded, config, data, ctx, progress=calib_progress, cancel=cancel,
                               recon_progress=recon_progress)
        qmodel, n_cal, t_cal, skipped = cal.qmodel, len(cal.image_ids), cal.seconds, cal.skipped
    images, idx = eval_split(loaded, config, data, n_eval)
    fn = evaluate_embeddings if loaded.info.modality == "text" else evaluate
    res = fn(loaded, qmodel, images, idx, batch_size, device, site_sqnr=site_sqnr, progress=progress, cancel=cancel,
             calib_images=n_cal, seconds_calibrate=t_cal, ctx=ctx)
    res.skipped_files = skipped + res.skipped_files
    res.skipped_images = len(res.skipped_files)
    res.data = DataSpec.of(data).record()
    return res, qmodel


def sensitivity(loaded: LoadedModel, config: QuantConfig, data: DataSpec | str | None = None, n_eval: int = 200, by: str = "kind",
                mode: str = "only", device: str = "cpu", progress: Progress | None = None,
                cancel: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
    """Quantize one group at a time (``mode='only'``) or all but one (``'all_but'``).

    Groups are site kinds (``by='kind'``) or residual blocks (``by='block'``). Returns rows
    ranked by the metric lost against full precision (top-1 where labeled, else agreement).
    """
    from .presets import QUANTIZED_ACT_KINDS

    if by == "kind":
        groups = {k: [k] for k in QUANTIZED_ACT_KINDS + ("weight",) if any(s.kind == k for s in loaded.sites)}
    elif by == "block":
        blocks = sorted({s.block for s in loaded.sites if s.block is not None})
        groups = {f"block {b}": [s.name for s in loaded.sites if s.block == b] for b in blocks}
    else:
        raise InputError(f"sensitivity by={by!r}: use 'kind' or 'block'")
    if mode not in ("only", "all_but"):
        raise InputError(f"sensitivity mode={mode!r}: use 'only' or 'all_but'")
    all_names = [s.name for s in loaded.sites]
    calib, _ = calibration_batch(loaded, config, data)
    images, idx = eval_split(loaded, config, data, n_eval)
    rows = []
    for gi, (label, members) in enumerate(groups.items()):
        member_set = set(members)
        if by == "kind":
            member_set = {s.name for s in loaded.sites if s.kind in members}
        keep = member_set if mode == "only" else set(all_names) - member_set
        overrides = dict(config.overrides)
        for name in all_names:
            if name not in keep:
                overrides[name] = {"enabled": False}
        cfg = QuantConfig.from_dict({**config.to_dict(), "overrides": overrides})
        with QuantizedModel(loaded, cfg) as qm:
            qm.calibrate(calib, cancel=cancel)
            r = evaluate(loaded, qm, images, idx, 64, device, site_sqnr=False, cancel=cancel)
        metric = "top1" if r.q_top1 is not None else "agreement"
        lost = (r.fp_top1 - r.q_top1) if r.q_top1 is not None else 100.0 - r.agreement
        rows.append({"group": label, "mode": mode, "sites": len(member_set), "q_top1": r.q_top1,
                     "agreement": r.agreement, "kl": r.kl, "metric": metric, "lost": lost})
        if progress:
            progress(gi + 1, len(groups), f"{label}: lost {lost:.2f}")
    rows.sort(key=lambda r: -r["lost"])
    return rows
