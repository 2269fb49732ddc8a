"""vizq's `ias-released` next to the unmodified released I&S-ViT code, on the same model and tensors.

The released code (github.com/zysxmu/IaS-ViT) is not part of vizq: point --code at a checkout of
it kept outside the project. This script imports its modules and calls them; it changes none of
their code. What it has to adapt, and why:
- the model is vizq's (the bundled ViT-Ti, or any timm ViT vizq loads), with the code's MatMul
  modules and attention forward attached as its ``build_model`` does; today's timm passes
  ``attn_mask`` to that forward, which takes ``x`` only, so the keyword is dropped;
- its parameters are made trainable again: vizq's loader freezes its copy, and the code trains
  ``filter(requires_grad, block.parameters())``. The code's ``quant_model`` hands each original
  bias Parameter to its QuantLinear, so a frozen copy trains weights but silently no biases —
  an earlier scratch wrapper did exactly that, and its W6A6 numbers were the code's without bias
  training (README: how ias-released was checked);
- ``.to("cuda")`` is a no-op (the code hard-codes ``device = 'cuda'`` in its reconstructions);
- the reconstruction batch is capped at the calibration count: with 32 samples and the code's 64,
  ``int(32 / 64)`` = 0 batches would be cached; ``randperm(32)[:32]`` draws what ``[:64]`` would;
- the code's global generator is seeded with the calibration seed before its first unit, where
  vizq seeds its own minibatch generator, so both draw the same minibatches.

Two checks:
  units: every stage-0 activation quantizer's parameters compared, then one block trained
         ``--iters`` steps in stage 1 by each side from the same start (prints each parameter's
         largest difference: 0 is bit-identical);
  main:  the code's own ``test_quant.main()`` end to end (top-1 after its stage 1 and stage 3) on
         vizq's calibration tensors and evaluation images; compare with
         ``python -m vizq eval --preset ias-released`` on the same arguments.

Run (one thread each, the AVX2 pin, as the README's figures):
  OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/ias_side_by_side.py units \
      --code DIR/IaS-ViT --data ../shared/data/imagenet-sample-500 --bits 6 --iters 200 --unit blocks.0
  ... main --code DIR/IaS-ViT --data ../shared/data/imagenet-sample-500 --bits 6 --iters 200 --images 468
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` finds vizq

import torch

from vizq.errors import VizqError
from vizq.models import load_model
from vizq.ptq import ias
from vizq.ptq.config import QuantConfig
from vizq.ptq.engine import QuantizedModel
from vizq.ptq.evaluate import calibration_batch, eval_split
from vizq.ptq.recon import _block_tensors

#: vizq's site names inside a block -> the code's quantizer (module, which input)
SITE_TO_CODE = {"norm1": "attn.qkv.in", "attn.q": "attn.matmul1.A", "attn.k": "attn.matmul1.B",
                "attn.v": "attn.matmul2.B", "attn.softmax": "attn.matmul2.A", "attn.proj_in": "attn.proj.in",
                "norm2": "mlp.fc1.in", "mlp.act": "mlp.fc2.in"}
#: the code's parameter names for each vizq quantizer state entry
STATE_TO_CODE = {"scale": "delta", "zero_point": "zero_point", "shift": "delta", "lo": "minv", "hi": "maxv"}


def code_modules(code: str) -> types.SimpleNamespace:
    """The released code's modules, imported from the checkout, plus the adaptations above."""
    sys.path.insert(0, code)
    import test_quant as T
    from quant import quant_model, set_quant_state
    from quant.block_recon import block_reconstruction
    from quant.quant_modules import QuantLinear, QuantMatMul
    from quant.quantizer import lp_loss
    from utils.build_model import MatMul, attention_forward
    _to = torch.Tensor.to
    torch.Tensor.to = lambda self, *a, **k: self if (a and str(a[0]).startswith("cuda")) else _to(self, *a, **k)
    torch.cuda.empty_cache = lambda: None
    return types.SimpleNamespace(T=T, quant_model=quant_model, set_quant_state=set_quant_state, lp_loss=lp_loss,
                                 block_reconstruction=block_reconstruction, QuantLinear=QuantLinear,
                                 QuantMatMul=QuantMatMul, MatMul=MatMul, attention_forward=attention_forward)


def code_model(C: types.SimpleNamespace, model: torch.nn.Module) -> torch.nn.Module:
    """What the code's ``build_model`` returns, built on vizq's model (trainable, as timm gives it)."""
    from timm.models.vision_transformer import Attention
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.requires_grad_(True)
    for mod in m.modules():
        if isinstance(mod, Attention):
            mod.matmul1, mod.matmul2 = C.MatMul(), C.MatMul()
            mod.forward = types.MethodType(lambda self, x, attn_mask=None, **kw: C.attention_forward(self, x), mod)
    return m


def code_quantizers(C: types.SimpleNamespace, qmod: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for n, m in qmod.named_modules():
        if isinstance(m, C.QuantLinear):
            out[n + ".in"] = {"delta": m.input_quantizer.delta, "zero_point": m.input_quantizer.zero_point}
        elif isinstance(m, C.QuantMatMul):
            for tag, q in (("A", m.quantizer_A), ("B", m.quantizer_B)):
                keys = ("delta", "minv", "maxv") if hasattr(q, "maxv") else ("delta", "zero_point")
                out[f"{n}.{tag}"] = {k: torch.as_tensor(getattr(q, k)) for k in keys}
    return out


def code_name(site: str) -> str:
    if site == "head:input":
        return "head.in"
    _, b, rest = site.split(".", 2)
    return f"blocks.{b}.{SITE_TO_CODE[rest]}"


def largest(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().reshape(-1).double() - b.detach().reshape(-1).double()).abs().max().item()


def units(a: argparse.Namespace, loaded, cfg: QuantConfig, x: torch.Tensor) -> None:
    C = code_modules(a.code)
    qm = QuantizedModel(loaded, cfg)
    with torch.no_grad():  # ias.calibrate's stage 0
        qm.model(x)
    qmod = C.quant_model(code_model(C, loaded.model), input_quant_params={"n_bits": a.bits, "channel_wise": False},
                         weight_quant_params={"n_bits": a.bits, "channel_wise": True})
    qmod.eval()
    C.set_quant_state(qmod, input_quant=True, weight_quant=False)
    with torch.no_grad():
        qmod(x[:64])
    theirs = code_quantizers(C, qmod)
    worst = 0.0
    for site, aq in qm.acts.items():
        for k, v in aq.q.state.items():
            worst = max(worst, largest(v, theirs[code_name(site)][STATE_TO_CODE[k]]))
    print(f"stage 0: {len(qm.acts)} activation quantizers, largest parameter difference {worst:.3g}")
    inp = _block_tensors(qm._fp[0], a.unit, x, inputs=True)[0]
    tgt = _block_tensors(qm._fp[0], a.unit, x, inputs=False)[0]
    teacher = copy.deepcopy(qmod)
    C.set_quant_state(teacher, False, False)
    teacher.eval()
    t0 = time.time()
    torch.manual_seed(cfg.calibration.seed)
    C.block_reconstruction(qmod, qmod.get_submodule(a.unit), teacher, teacher.get_submodule(a.unit), cali_data=x,
                           batch_size=min(64, len(x)), iters=a.iters, opt_mode="mse", asym=True, warmup=0.2,
                           act_quant=True, weight_quant=False)
    t_code = time.time() - t0
    t0 = time.time()
    ias._train(qm, a.unit, inp, tgt, a.iters, False, torch.Generator().manual_seed(cfg.calibration.seed), lambda it: None)
    t_vizq = time.time() - t0
    theirs = dict(qmod.get_submodule(a.unit).named_parameters())
    print(f"{a.unit}, stage 1, {a.iters} steps ({t_code:.0f} s the code, {t_vizq:.0f} s vizq):")
    for p in ias._weights_in(qm, a.unit):
        rel = p[len(a.unit) + 1:]
        print(f"  {rel}.weight: largest difference {largest(qm.fp_weights[p], theirs[rel + '.weight']):.3g}; "
              f"{rel}.bias: {largest(qm.model.get_submodule(p).bias, theirs[rel + '.bias']):.3g}")


def main_run(a: argparse.Namespace, loaded, cfg: QuantConfig, x: torch.Tensor) -> None:
    C = code_modules(a.code)
    T = C.T
    images, idx = eval_split(loaded, cfg, a.data, a.images)
    val = [(xb, torch.as_tensor(yb)) for xb, yb, _ in loaded.iterate(images, idx, 100)]
    T.build_model = lambda name: code_model(C, loaded.model)
    T.build_dataset = lambda args: ([(x, torch.zeros(len(x), dtype=torch.long))], val)
    first = [True]

    def adapted(fn):
        def run(*args, **kw):
            if first[0]:
                torch.manual_seed(cfg.calibration.seed)
                first[0] = False
            kw["batch_size"] = min(kw["batch_size"], kw["cali_data"].shape[0])
            return fn(*args, **kw)
        return run

    T.layer_reconstruction = adapted(T.layer_reconstruction)
    T.block_reconstruction = adapted(T.block_reconstruction)
    parser = argparse.ArgumentParser("I&S-ViT", parents=[T.get_args_parser()])
    T.args = parser.parse_args(["--model", "vit_tiny", "--device", "cpu", "--w_bits", str(a.bits), "--a_bits",
                                str(a.bits), "--w_cw", "--iter", str(a.iters), "--print-freq", "1000"])
    t0 = time.time()
    T.main()  # prints " * Prec@1 ..." after its stage 1 and after stage 3
    print(f"the released code: {time.time() - t0:.0f} s, {len(x)} calibration images, {len(idx)} evaluated")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("check", choices=["units", "main"])
    ap.add_argument("--code", required=True, help="a checkout of github.com/zysxmu/IaS-ViT")
    ap.add_argument("--model", default="vit_tiny_patch16_224.augreg_in21k_ft_in1k")
    ap.add_argument("--data", required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--unit", default="blocks.0")
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images", type=int, default=468)
    a = ap.parse_args()
    if not (Path(a.code) / "test_quant.py").is_file():
        ap.error(f"--code {a.code}: no test_quant.py there; give the top folder of a checkout of zysxmu/IaS-ViT")
    if a.check == "units" and not re.fullmatch(r"blocks\.\d+", a.unit):
        ap.error(f"--unit {a.unit!r}: give one ViT block, e.g. blocks.0 (the code's block reconstruction is compared)")
    try:
        loaded = load_model(a.model)
        cfg = QuantConfig(preset="ias-released", wbits=a.bits, abits=a.bits)
        cfg.calibration.images, cfg.calibration.seed = a.calib, a.seed
        x, _ = calibration_batch(loaded, cfg, a.data)
        (units if a.check == "units" else main_run)(a, loaded, cfg, x)
    except VizqError as e:  # a bad --model, --data or --bits: vizq's own one-line message
        ap.error(str(e))


if __name__ == "__main__":
    main()
