"""How much a preset's top-1 moves with the calibration set alone: presets x bit widths x seeds.

The seed picks the calibration images (and so which of the rest are evaluated); nothing else
in a preset is random. Prints one markdown row per preset and width: top-1 per seed, mean,
range (max - min), and the full-precision top-1 range over the same evaluation sets.

Run (the README's spread tables):
  .venv/bin/python bench/seed_spread.py --model vit_tiny_patch16_224.augreg_in21k_ft_in1k \
      --data ../shared/data/imagenet-sample-500 --presets repq,adalog --bits 6,8 --seeds 0,1,2,3,4 \
      --calib 32 --images 468 [--gptq [--gptq-act-order] [--gptaq] [--gptq-damp F]] [--override RULE ...] [--json spread.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` finds vizq

from vizq.dataspec import DataSpec
from vizq.models import load_model
from vizq.ptq.config import GPTQ_DAMP, QuantConfig, overrides_from_rules
from vizq.ptq.evaluate import run_eval


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="vizq-vit-tiny")
    ap.add_argument("--data", default="bundled")
    ap.add_argument("--presets", default="repq")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--images", type=int, default=468)
    ap.add_argument("--gptq", action="store_true", help="GPTQ weight rounding (QuantConfig.gptq) for every job")
    ap.add_argument("--gptq-act-order", action="store_true", help="with --gptq: GPTQ's act order (QuantConfig.gptq_act_order)")
    ap.add_argument("--gptaq", action="store_true", help="with --gptq: GPTAQ's asymmetric target (QuantConfig.gptaq)")
    ap.add_argument("--gptq-damp", type=float, default=GPTQ_DAMP, help="with --gptq: GPTQ's damping (QuantConfig.gptq_damp)")
    ap.add_argument("--override", action="append", default=[], help="as vizq eval's --override, for every job (repeatable)")
    ap.add_argument("--json")
    a = ap.parse_args()
    lm = load_model(a.model)
    data = DataSpec.of(a.data)
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = []
    label = (" --gptq" + (" --gptq-act-order" if a.gptq_act_order else "") + (" --gptaq" if a.gptaq else "")
             + (f" --gptq-damp {a.gptq_damp:g}" if a.gptq_damp != GPTQ_DAMP else "") if a.gptq else "") + "".join(
        f" --override {r}" for r in a.override)
    print("| preset | W/A | top-1 (%), seeds " + ", ".join(map(str, seeds)) + " | mean | range | FP top-1 range | calib s (median) |")
    print("|---|---|---|---|---|---|---|")
    for preset in a.presets.split(","):
        for b in (int(x) for x in a.bits.split(",")):
            top1, fp, secs = [], [], []
            for seed in seeds:
                cfg = QuantConfig.from_dict({"preset": preset, "wbits": b, "abits": b, "gptq": a.gptq,
                                             "gptq_act_order": a.gptq_act_order, "gptaq": a.gptaq,
                                             "gptq_damp": a.gptq_damp, "overrides": overrides_from_rules(a.override),
                                             "calibration": {"images": a.calib, "seed": seed}})
                res, qm = run_eval(lm, cfg, data, n_eval=a.images, site_sqnr=False)  # top-1 is all it reports
                qm.remove_hooks()
                top1.append(res.q_top1 if res.q_top1 is not None else res.agreement)
                fp.append(res.fp_top1 if res.fp_top1 is not None else 100.0)
                secs.append(res.seconds_calibrate)
            row = {"preset": preset, "gptq": a.gptq, "gptq_act_order": a.gptq_act_order, "gptaq": a.gptaq,
                   "gptq_damp": a.gptq_damp, "overrides": a.override,
                   "bits": b, "seeds": seeds, "top1": top1, "fp_top1": fp, "seconds": secs,
                   "mean": statistics.mean(top1), "range": max(top1) - min(top1)}
            rows.append(row)
            print(f"| `{preset}`{label} | {b}/{b} | {', '.join(f'{t:.2f}' for t in top1)} | {row['mean']:.2f} | "
                  f"{row['range']:.2f} | {min(fp):.2f}–{max(fp):.2f} | {statistics.median(secs):.0f} |", flush=True)
    if a.json:
        from vizq import atomic

        atomic.write_text(a.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
