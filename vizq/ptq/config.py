"""``QuantConfig``: what to quantize and how, as a versioned dataclass with an exact
JSON/YAML round trip. Invalid configs are rejected with the offending key named."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from ..errors import InputError, VizqError
from ..sites import KINDS

#: 2: ``method`` renamed ``preset`` (a quantizer's own range search is its ``method`` option,
#: a different thing). 3: ``ptq4vit`` became the released code's form; what it meant before is
#: ``ptq4vit-mse``. Older files still load: :func:`migrate` renames what changed.
CONFIG_VERSION = 3
GPTQ_DAMP = 0.01  # QuantConfig.gptq_damp's default, GPTQ's released percdamp (ptq/gptq.py: DAMP)


class ReconLoss(str, Enum):
    """What block reconstruction minimises (ptq/recon.py: ``block_loss``).

    MSE is BRECQ's and QDrop's loss. TOKEN weighs each token's squared error by the inverse of
    that token's mean square in the float output: from block 7 of ViT-Ti on, 0.1 % of the
    residual values (massive activations near 575) carry over 90 % of the output's energy, so
    plain MSE spends the whole reconstruction on a few values that the next LayerNorm divides
    away, and ordinary tokens barely count (README: the measured effect)."""

    MSE = "mse"
    TOKEN = "token"
#: A configuration is a few kilobytes; anything far larger is a mistake (or hostile) and would
#: take minutes to parse and validate, so it is refused before parsing.
MAX_CONFIG_BYTES = 1 << 20
RULE_KEYS = {"quantizer", "bits", "options", "enabled"}


class ConfigError(VizqError, ValueError):
    """A configuration that cannot be used; the message names the key."""


@dataclass
class CalibrationConfig:
    images: int = 32
    seed: int = 0
    batch_size: int = 32

    def validate(self) -> None:
        for key in ("images", "batch_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"calibration.{key} must be a positive integer, got {v!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"calibration.seed must be an integer, got {self.seed!r}")


@dataclass(frozen=True)
class Rule:
    """One override: which sites (``target``: a site kind, a glob over site names, or a name)
    and what changes there. ``None`` fields keep what the preset (or an earlier rule) chose.
    Configurations store rules as plain mappings (``QuantConfig.overrides``); this is their
    checked, typed form."""

    target: str
    quantizer: str | None = None
    bits: int | None = None
    options: dict[str, Any] | None = None
    enabled: bool | None = None

    @property
    def is_kind(self) -> bool:
        return is_kind_key(self.target)

    @classmethod
    def parse(cls, key: str, rule: Any) -> "Rule":
        from ..quant import list_quantizers, quantizer_class

        if not isinstance(rule, dict):
            raise ConfigError(f"overrides[{key!r}] must be a mapping, got {type(rule).__name__}")
        bad = set(rule) - RULE_KEYS
        if bad:
            raise ConfigError(f"overrides[{key!r}] has unknown key {sorted(bad)[0]!r}; allowed: {sorted(RULE_KEYS)}")
        q = rule.get("quantizer")
        if q is not None and q not in list_quantizers():
            raise ConfigError(f"overrides[{key!r}].quantizer {q!r} is unknown; choose one of {', '.join(list_quantizers())}")
        bits = rule.get("bits")
        if bits is not None:
            lo, hi = quantizer_class(q).bit_range if q else (2, 16)
            if not isinstance(bits, int) or isinstance(bits, bool) or not lo <= bits <= hi:
                raise ConfigError(f"overrides[{key!r}].bits={bits!r} is out of range {lo}..{hi}")
        if "options" in rule and not isinstance(rule["options"], dict):
            raise ConfigError(f"overrides[{key!r}].options must be a mapping")
        if "enabled" in rule and not isinstance(rule["enabled"], bool):
            raise ConfigError(f"overrides[{key!r}].enabled must be true or false")
        return cls(key, q, bits, rule.get("options"), rule.get("enabled"))


@dataclass
class QuantConfig:
    """A preset, bit widths, per-site overrides and calibration settings.

    ``overrides`` keys are a site kind (``post_softmax``), a glob over site names
    (``blocks.*.attn.softmax``) or an exact name; values hold any of ``quantizer``, ``bits``,
    ``options``, ``enabled``. Kind keys apply first, then globs in order (later wins).
    """

    preset: str = "minmax"
    wbits: int = 4
    abits: int = 4
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    reparam: str | None = None  # None: the preset decides; "none", "mean" or "median" to force
    recon_iters: int = 0
    recon_scales: bool = False  # reconstruction also learns uniform activation scales (LSQ)
    recon_batch: int = 0  # samples per reconstruction step, drawn at random; 0: every calibration sample
    recon_loss: ReconLoss = ReconLoss.MSE  # what reconstruction minimises (ReconLoss)
    #: reconstruction trains on each calibration image and recon_views − 1 seeded random crops and
    #: flips of it (ptq/views.py); ranges and GPTQ still see the images alone. 1: the images only
    recon_views: int = 1
    #: with reconstruction: only the first range_images calibration samples set what is computed
    #: in closed form (activation ranges, AdaLog's bases, the post-LN fold, GPTQ), and block
    #: reconstruction trains on all of them; 0: every step sees every sample. Why: on the real
    #: ViT-Ti at W4A4 the gain of more calibration images is mostly the reconstruction's, while
    #: their cost is mostly the searches' (README: "More calibration images")
    range_images: int = 0
    gptq: bool = False  # weights rounded with GPTQ's error compensation on the float calibration inputs (ptq/gptq.py)
    gptq_act_order: bool = False  # with gptq: columns rounded by decreasing input energy (GPTQ's act order)
    gptaq: bool = False  # with gptq: GPTAQ's asymmetric target, the float layer on the float inputs (ptq/gptq.py)
    #: with gptq: λ = gptq_damp · mean(diag XᵀX) added to the Gram before inverting it (GPTQ's percdamp;
    #: GPTAQ's ViT script runs 0.1)
    gptq_damp: float = GPTQ_DAMP
    #: ias-released: Adam steps per block in each of its two reconstructions (0: the released
    #: code's own, 1,000, or 200 at W6A6)
    ias_iters: int = 0
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.calibration, dict):
            unknown = set(self.calibration) - {"images", "seed", "batch_size"}
            if unknown:
                raise ConfigError(f"unknown key(s) calibration.{sorted(unknown)[0]}; allowed: images, seed, batch_size")
            self.calibration = CalibrationConfig(**self.calibration)
        if isinstance(self.recon_loss, str) and self.recon_loss in {r.value for r in ReconLoss}:  # text from a file or the CLI; anything else: validate()
            self.recon_loss = ReconLoss(self.recon_loss)
        if type(self.gptq_damp) is int:  # a YAML/JSON 1 means 1.0; stored as what the engine uses
            self.gptq_damp = float(self.gptq_damp)
        self.validate()

    def validate(self) -> None:
        from .catalog import PRESETS, Procedure

        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise ConfigError(f"version must be a positive integer, got {self.version!r}")
        if self.version > CONFIG_VERSION:
            raise ConfigError(f"version {self.version} is newer than this vizq understands ({CONFIG_VERSION}); upgrade vizq")
        if self.preset not in PRESETS:
            raise ConfigError(f"preset {self.preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        for key in ("wbits", "abits"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 2 <= v <= 16:
                raise ConfigError(f"{key} must be an integer from 2 to 16, got {v!r}")
        if self.reparam not in (None, "none", "mean", "median", "mean_int"):
            raise ConfigError(f"reparam must be none, mean, median or mean_int, got {self.reparam!r}")
        if not isinstance(self.recon_iters, int) or isinstance(self.recon_iters, bool) or self.recon_iters < 0:
            raise ConfigError(f"recon_iters must be a non-negative integer, got {self.recon_iters!r}")
        if not isinstance(self.recon_batch, int) or isinstance(self.recon_batch, bool) or self.recon_batch < 0:
            raise ConfigError(f"recon_batch must be a non-negative integer (0: every calibration sample), got {self.recon_batch!r}")
        if not isinstance(self.recon_views, int) or isinstance(self.recon_views, bool) or self.recon_views < 1:
            raise ConfigError(f"recon_views must be a positive integer (1: the calibration images alone), got {self.recon_views!r}")
        if self.recon_views > 1 and not self.recon_iters:
            raise ConfigError("recon_views adds augmented views for block reconstruction; set recon_iters > 0 too")
        if not isinstance(self.range_images, int) or isinstance(self.range_images, bool) or self.range_images < 0:
            raise ConfigError(f"range_images must be a non-negative integer (0: every calibration sample), got {self.range_images!r}")
        if self.range_images and not self.recon_iters:
            raise ConfigError("range_images keeps the other calibration samples for block reconstruction; set recon_iters > 0 too")
        if self.range_images > self.calibration.images:
            raise ConfigError(f"range_images ({self.range_images}) is more than the {self.calibration.images} calibration "
                              "images; use at most calibration.images")
        if not isinstance(self.recon_scales, bool):
            raise ConfigError(f"recon_scales must be true or false, got {self.recon_scales!r}")
        if not isinstance(self.recon_loss, ReconLoss):
            raise ConfigError(f"recon_loss must be one of {', '.join(r.value for r in ReconLoss)}, got {self.recon_loss!r}")
        if self.recon_loss is not ReconLoss.MSE and not self.recon_iters:
            raise ConfigError("recon_loss chooses what block reconstruction minimises; set recon_iters > 0 too")
        if self.recon_scales and not self.recon_iters:
            raise ConfigError("recon_scales learns activation scales during reconstruction; set recon_iters > 0 too")
        if not isinstance(self.gptq, bool):
            raise ConfigError(f"gptq must be true or false, got {self.gptq!r}")
        if self.gptq and PRESETS[self.preset].procedure is not Procedure.SEQUENTIAL:
            raise ConfigError(f"gptq rounds weights within the sequential calibration; preset {self.preset!r} runs "
                              "its own procedure (use another preset, or drop gptq)")
        if not isinstance(self.gptq_act_order, bool):
            raise ConfigError(f"gptq_act_order must be true or false, got {self.gptq_act_order!r}")
        if self.gptq_act_order and not self.gptq:
            raise ConfigError("gptq_act_order orders GPTQ's column rounding; set gptq too")
        if not isinstance(self.gptaq, bool):
            raise ConfigError(f"gptaq must be true or false, got {self.gptaq!r}")
        if self.gptaq and not self.gptq:
            raise ConfigError("gptaq changes what GPTQ's rounding compensates; set gptq too")
        d = self.gptq_damp
        if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0 < d <= 1:
            raise ConfigError(f"gptq_damp must be a number above 0 and at most 1 (GPTQ's {GPTQ_DAMP} by default), got {d!r}")
        if d != GPTQ_DAMP and not self.gptq:
            raise ConfigError("gptq_damp damps the Gram matrix GPTQ's rounding inverts; set gptq too")
        if self.gptq and PRESETS[self.preset].fixed_format:
            raise ConfigError(f"gptq compensates rounding on a uniform integer grid; preset {self.preset!r} "
                              "quantizes weights in a float or block format (use an integer preset, or drop gptq)")
        if not isinstance(self.ias_iters, int) or isinstance(self.ias_iters, bool) or self.ias_iters < 0:
            raise ConfigError(f"ias_iters must be a non-negative integer (0: the released code's steps), got {self.ias_iters!r}")
        is_ias = PRESETS[self.preset].procedure is Procedure.IAS
        if self.ias_iters and not is_ias:
            raise ConfigError(f"ias_iters sets the steps of ias-released's own reconstructions; preset {self.preset!r} "
                              "has none (use recon_iters for block reconstruction)")
        if is_ias and self.recon_iters:
            raise ConfigError("ias-released runs its own two reconstructions; recon_iters would add a third "
                              "(set ias_iters for their steps, or drop recon_iters)")
        if not isinstance(self.overrides, dict):
            raise ConfigError("overrides must be a mapping of site glob or kind to settings")
        self.rules()  # every override parses into a typed Rule, or the error names it
        self.calibration.validate()

    def rules(self) -> list["Rule"]:
        """The overrides as typed rules, in the order they apply: site kinds first, then globs
        and exact names in the order given (a later rule wins)."""
        rules = [Rule.parse(k, r) for k, r in self.overrides.items()]
        return [r for r in rules if r.is_kind] + [r for r in rules if not r.is_kind]

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["recon_loss"] = self.recon_loss.value  # plain text, so YAML's safe dumper and old readers take it
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantConfig":
        if not isinstance(d, dict):
            raise ConfigError("a configuration must be a mapping")
        d = migrate(d)
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - allowed
        if unknown:
            raise ConfigError(f"unknown key {sorted(unknown)[0]!r}; allowed keys: {', '.join(sorted(allowed))}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(str(e)) from e

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_text(cls, text: str) -> "QuantConfig":
        """Parse JSON or YAML (YAML is a superset; ``yaml.safe_load``)."""
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"the configuration is {len(text) / 1e6:.1f} MB; a vizq config is a few kB "
                              f"(limit {MAX_CONFIG_BYTES // 1024} kB): check that this is the right file")
        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"not valid JSON/YAML: {e}") from e
        if isinstance(d, dict) and "config" in d and "preset" not in d and "method" not in d:
            d = d["config"]  # an export's config.json wraps nothing, but accept {"config": …}
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str | Path) -> "QuantConfig":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"configuration file {str(p)!r} does not exist")
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{p.name} is {size / 1e6:.1f} MB; a vizq config is a few kB "
                              f"(limit {MAX_CONFIG_BYTES // 1024} kB): check that this is the right file")
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            raise ConfigError(f"{p.name} is not a text file; pass a JSON or YAML configuration") from None
        return cls.from_text(text)

    def save(self, path: str | Path) -> None:
        from .. import atomic

        text = self.to_yaml() if str(path).endswith((".yaml", ".yml")) else self.to_json()
        atomic.write_text(path, text)


def options_label(config: dict[str, Any] | None) -> str:
    """The weight-rounding and reconstruction options of a recorded run, for tables and legends:
    '' (none), or e.g. '+gptq act order · +recon 200 · LSQ · batch 8'. Works on the stored dict, so old
    history rows (which lack the newer keys) read too."""
    config = config or {}
    parts = []
    if config.get("gptq"):
        parts.append(("+gptaq" if config.get("gptaq") else "+gptq") + (" act order" if config.get("gptq_act_order") else ""))
        damp = config.get("gptq_damp", GPTQ_DAMP)
        if damp != GPTQ_DAMP:
            parts[-1] += f" damp {damp:g}"
    iters = config.get("recon_iters") or 0
    if iters:
        parts.append(f"+recon {iters}")
        if config.get("recon_scales"):
            parts.append("LSQ")
        if config.get("recon_batch"):
            parts.append(f"batch {config['recon_batch']}")
        if config.get("range_images"):
            parts.append(f"ranges on {config['range_images']}")
        if config.get("recon_views", 1) > 1:
            parts.append(f"{config['recon_views']} views")
        if config.get("recon_loss", ReconLoss.MSE.value) != ReconLoss.MSE.value:
            parts.append(f"{config['recon_loss']} loss")
    if config.get("ias_iters"):
        parts.append(f"{config['ias_iters']} steps a block")
    return " · ".join(parts)


def migrate(d: dict[str, Any]) -> dict[str, Any]:
    """An older configuration's keys in this version's words (the input is not modified)."""
    version = d.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version < CONFIG_VERSION:
        return d  # current, or newer/invalid: validate() says so
    d = dict(d)
    if version < 2 and "method" in d and "preset" not in d:
        d["preset"] = d.pop("method")
    if version < 3 and d.get("preset") == "ptq4vit":
        d["preset"] = "ptq4vit-mse"
    d["version"] = CONFIG_VERSION
    return d


def is_kind_key(key: str) -> bool:
    return key in KINDS


def overrides_from_rules(texts: list[str]) -> dict[str, dict[str, Any]]:
    """``SITE_OR_KIND=QUANTIZER[:bits=N][:key=value]`` rules as a QuantConfig overrides map."""
    from ..lab import parse_quantizer

    overrides = {}
    for text in texts:
        if "=" not in text:
            raise InputError(f"--override {text!r} must look like SITE_OR_KIND=QUANTIZER[:bits=N]")
        key, rhs = text.split("=", 1)
        name, opts = parse_quantizer(rhs)
        rule = {"quantizer": name}
        if "bits" in opts:
            rule["bits"] = opts.pop("bits")
        if opts:
            rule["options"] = opts
        overrides[key] = rule
    return overrides
