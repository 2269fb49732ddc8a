"""The published methods as data: which quantizer each site kind gets under each preset.

Only records, no logic: ``presets`` turns a record and a config into per-site quantizers, and
``config`` checks a preset name against this table, so neither has to import the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

QUANTIZED_ACT_KINDS = ("post_ln", "post_softmax", "post_gelu", "q", "k", "v", "attn_proj_in", "linear_in")
GELU_SHIFT = 0.16997  # |min GELU|: AdaLog quantizes x + η and folds -Ŵη into fc2's bias
GELU_SHIFT_RELEASED = 0.16997124254703522  # the same, to the digits AdaLog's released code uses
PATCH_INPUT_BITS = 8


class Procedure(str, Enum):
    """How a preset calibrates: which algorithm picks every quantizer's parameters."""

    SEQUENTIAL = "sequential"  # RepQ-ViT's pass: network order, quantized upstream, then the fold
    PTQ4VIT = "ptq4vit"  # PTQ4ViT's released code: per layer on float inputs, output-scored (ptq4vit.py)
    ADALOG = "adalog"  # AdaLog's released code: per layer on float inputs, FPCS range/zero-point searches (adalog.py)
    IAS = "ias"  # I&S-ViT's released code: ranges on float weights, two block-reconstruction stages around the fold (ias.py)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    acts: dict[str, tuple[str, dict[str, Any]]]  # kind -> (quantizer, options); others: default
    default_act: tuple[str, dict[str, Any]]
    weights: tuple[str, dict[str, Any]]
    reparam: str = "none"  # post-LN scale folding: none / mean / median
    fixed_format: bool = False  # FP formats: bit widths come from the format
    shifts: dict[str, float] = field(default_factory=dict)
    paper: str = ""
    patch_input: tuple[str, dict[str, Any]] | None = ("uniform", {"method": "minmax"})  # at PATCH_INPUT_BITS; None: float
    token_relative: bool = False  # output-scored Linear inputs: per-token relative error (massive activations)
    procedure: Procedure = Procedure.SEQUENTIAL
    weight_rules: tuple[tuple[str, tuple[str, dict[str, Any]]], ...] = ()  # (module glob, quantizer): first match wins
    # the model kinds (``ModelInfo.modality``) it applies to: PTQ4ViT's metric is the KL of a
    # classifier's softmax, which a sentence encoder's embedding does not have
    modalities: tuple[str, ...] = ("image", "text")
    cost: str = ""  # what calibration costs, where it is far above seconds (shown before a run starts)


_PCT = {"method": "percentile"}
_W_PC = ("uniform", {"granularity": "out_channel", "method": "percentile"})
_LN_PC = ("uniform", {"granularity": "channel", "method": "percentile"})

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("minmax", "per-tensor uniform min/max everywhere (naive baseline)", {},
               ("uniform", {"method": "minmax"}), ("uniform", {"method": "minmax"})),
        Preset("ptq4vit", "PTQ4ViT as its released code does it: every layer calibrated on float inputs; symmetric "
               "steps, split-of-softmax and twin post-GELU searched on each layer's output with the code's Hessian "
               "metric, whose gradient is taken on the float model (rounding noise: README); weights per tensor "
               "(q, k, v apart), q/k/v per head, patch-embedding input float",
               {"post_softmax": ("ptq4vit_softmax", {}), "post_gelu": ("ptq4vit_gelu", {}),
                **{k: ("uniform_sym", {"granularity": "head"}) for k in ("q", "k", "v")}},
               ("uniform_sym", {}), ("uniform_sym", {}), paper="PTQ4ViT (ECCV'22)", patch_input=None,
               procedure=Procedure.PTQ4VIT, modalities=("image",),
               cost="slow by design: 100 candidate steps × 3 rounds × weight and input of every layer, each scored on "
                    "the layer's output; ViT-Ti with 32 calibration images takes about 20 minutes on 2 CPU cores "
                    "(time grows with the images)",
               weight_rules=(("*.qkv", ("uniform_sym", {"granularity": "out_channel"})),
                             ("patch_embed.*", ("uniform_sym", {"granularity": "out_channel"})))),
        Preset("ptq4vit-mse", "vizq's variant of PTQ4ViT (the preset called ptq4vit before vizq had the released "
               "code's form): the paper's twin-uniform grids (Δ2 = Δ1·2^m) for softmax and post-GELU, MSE-searched "
               "asymmetric uniform elsewhere, per-channel weights, RepQ-ViT's sequential calibration",
               {"post_softmax": ("twin", {"mode": "softmax"}), "post_gelu": ("twin", {"mode": "gelu"})},
               ("uniform", {"method": "mse"}), ("uniform", {"granularity": "out_channel", "method": "mse"})),
        Preset("repq", "RepQ-ViT as its released code does it: per-channel post-LN folded (mean scale, "
               "unrounded mean zero point), log√2 softmax, 0.999/0.9999/0.99999-quantile searches on whole tensors",
               {"post_ln": _LN_PC, "post_softmax": ("logsqrt2", _PCT)},
               ("uniform", _PCT), _W_PC, reparam="mean", paper="RepQ-ViT (ICCV'23)", patch_input=("uniform", _PCT)),
        Preset("repq+", "vizq's refinement of repq: post-GELU range chosen by the next Linear's output error "
               "per token (massive activations then get clipped instead of erasing every ordinary value), "
               "exact integer-zero-point fold, finer log√2 scale search",
               {"post_ln": _LN_PC, "post_softmax": ("logsqrt2", {"method": "mse"})},
               ("uniform", _PCT), _W_PC, reparam="mean_int", patch_input=("uniform", _PCT), token_relative=True),
        Preset("dopq", "TanQ softmax (our reading of the paper: DopQ-ViT has no public code), post-LN folded with the "
               "median scale (MOSF), no reconstruction",
               {"post_ln": _LN_PC, "post_softmax": ("tanq", {})},
               ("uniform", _PCT), _W_PC, reparam="median", paper="DopQ-ViT", patch_input=("uniform", _PCT)),
        Preset("adalog", "AdaLog's searched-base log quantizers for softmax and bias-shifted post-GELU (output-scored) on "
               "RepQ-ViT's calibration; the released code searches every uniform range by layer output instead "
               "(that is adalog-released)",
               {"post_ln": _LN_PC, "post_softmax": ("adalog", {}), "post_gelu": ("adalog", {"signed": False})},
               ("uniform", _PCT), _W_PC, reparam="mean", shifts={"post_gelu": GELU_SHIFT}, paper="AdaLog (ECCV'24)",
               patch_input=("uniform", _PCT)),
        Preset("adalog-released", "AdaLog as its released code does it: every layer calibrated on float inputs; "
               "asymmetric ranges and zero points of every weight row and input searched by FPCS, first on their "
               "own MSE, then 3 rounds on the layer's output; post-LN per channel folded (mean scale, rounded mean "
               "zero point); searched-base log softmax (scale 1) and shifted post-GELU; q/k/v per head; "
               "patch-embedding input float",
               {"post_softmax": ("adalog", {"signed": False, "table": "released"}),
                "post_gelu": ("adalog", {"signed": False, "table": "released"}),
                **{k: ("uniform", {"granularity": "head"}) for k in ("q", "k", "v")}},
               ("uniform", {}), ("uniform", {"granularity": "out_channel"}), shifts={"post_gelu": GELU_SHIFT_RELEASED},
               paper="AdaLog (ECCV'24)", patch_input=None, procedure=Procedure.ADALOG, modalities=("image",),
               cost="slow by design: 128 candidates × 6 FPCS passes × 3 rounds for the weight rows and the input of "
                    "every layer, each scored on the layer's output, as the released code does; ViT-Ti with 32 "
                    "calibration images takes about an hour a block on one CPU thread (measured), so about half a "
                    "day for the model on a CPU"),
        Preset("ias", "SULQ softmax, per-channel post-LN folded (mean); optional block reconstruction (the released "
               "code always reconstructs; not compared side by side)",
               {"post_ln": _LN_PC, "post_softmax": ("sulq", {})},
               ("uniform", _PCT), _W_PC, reparam="mean", paper="I&S-ViT", patch_input=("uniform", _PCT)),
        Preset("ias-released", "I&S-ViT as its released code does it: activation ranges first (weights float), then "
               "each block's float weights and biases trained on its output (Adam, activations quantized), the "
               "post-LN fold (mean scale, unrounded mean zero point), weight rows searched over nine quantiles, "
               "and the same training again through the weight rounding; the code's SULQ softmax (integer "
               "exponents); patch-embedding input float",
               {"post_ln": _LN_PC, "post_softmax": ("sulq_released", {"signed": False})},
               ("uniform", _PCT), ("uniform", {"granularity": "out_channel", "method": "percentile_wide"}),
               reparam="mean", paper="I&S-ViT (TPAMI'25)", patch_input=None, procedure=Procedure.IAS,
               modalities=("image",),
               cost="slow by design: two reconstructions of every block, 1,000 Adam steps each at W4A4 (200 at "
                    "W6A6), as the released code runs them; ViT-Ti with 32 calibration images takes about an hour "
                    "and a half on 2 CPU cores (--ias-iters sets fewer steps)"),
        Preset("fp8", "FP8 E4M3 activations (per-tensor scale) and weights (per-channel scale)", {},
               ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "out_channel"}), fixed_format=True),
        Preset("mxfp4", "OCP MXFP4 (32-value E2M1 blocks, power-of-two scales) everywhere", {},
               ("mxfp4", {}), ("mxfp4", {}), fixed_format=True),
        Preset("nvfp4", "NVFP4 (16-value E2M1 blocks, E4M3 scales) everywhere", {},
               ("nvfp4", {}), ("nvfp4", {}), fixed_format=True),
    )
}

#: Kinds whose searches are scored on the output of the operation they feed (AdaLog's FPCS;
#: for repq+, the post-GELU range: the error of fc2's output, not of its input).
OUTPUT_SCORED = {"adalog": ("post_softmax", "post_gelu"), "repq+": ("post_gelu",)}


def presets_for(modality: str) -> list[str]:
    """The preset names that apply to a model of this modality, in table order."""
    return [n for n, p in PRESETS.items() if modality in p.modalities]
