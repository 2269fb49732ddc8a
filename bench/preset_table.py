"""Every preset at several bit widths on one model: the README's table (markdown).

Run: .venv/bin/python bench/preset_table.py [--model vizq-vit-tiny] [--bits 4,6,8] [--images 1000]
"""
from __future__ import annotations

import argparse

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` finds vizq

from vizq.models import load_model
from vizq.ptq.config import QuantConfig
from vizq.ptq.evaluate import run_eval
from vizq.ptq.presets import PRESETS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="vizq-vit-tiny")
    ap.add_argument("--bits", default="4,6,8")
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--methods", default=",".join(PRESETS))
    a = ap.parse_args()
    lm = load_model(a.model)
    text = lm.info.modality == "text"
    if text:
        print("| method | W/A | mean cosine | NN top-1 agreement (%) | recall@10 (%) | calib s |")
    else:
        print("| method | W/A | top-1 (%) | agreement (%) | KL(FP‖Q) | calib s |")
    print("|---|---|---|---|---|---|")
    fp = None
    for m in a.methods.split(","):
        for b in (int(x) for x in a.bits.split(",")):  # highest precision last
            res, qm = run_eval(lm, QuantConfig(preset=m, wbits=b, abits=b), n_eval=a.images)
            qm.remove_hooks()
            fp = res.fp_top1
            wa = "FP formats" if PRESETS[m].fixed_format else f"{b}/{b}"
            if text:
                mt = res.metrics
                print(f"| {m} | {wa} | {mt['mean_cosine']:.4f} | {mt['nn_top1_agreement']:.1f} | {mt['recall_at_10']:.1f} "
                      f"| {res.seconds_calibrate:.1f} |", flush=True)
            else:
                top = f"{res.q_top1:.2f}" if res.q_top1 is not None else "-"
                print(f"| {m} | {wa} | {top} | {res.agreement:.2f} | {res.kl:.4f} | {res.seconds_calibrate:.1f} |", flush=True)
            if PRESETS[m].fixed_format:
                break
    if not text:
        print(f"\nfull precision top-1: {fp}")


if __name__ == "__main__":
    main()
