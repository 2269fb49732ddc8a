"""The site taxonomy: every quantizable tensor of a model, with a stable name and a kind.

A *site* is where a tensor can be observed or quantized: the output of a module (LayerNorm,
GELU, an attention tap, a block), the input of a Linear that no other site covers (the
classifier head, the patch embedding), or a weight. Names are module paths
(``blocks.3.attn.softmax``); input ports read ``head:input``, weights ``blocks.3.attn.qkv.weight``.

Discovery goes by structure, not by class name lists, so ViT, DeiT and Swin (and any model
built from the same parts) are covered by the same few rules (``RULES``).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Iterable

from torch import nn

from .arch import TAPPED
from .errors import InputError

KINDS = (
    "post_ln",
    "post_softmax",
    "post_gelu",
    "q",
    "k",
    "v",
    "attn_proj_in",
    "residual",
    "linear_in",
    "weight",
)
ACTIVATION_KINDS = tuple(k for k in KINDS if k != "weight")

KIND_HELP = {
    "post_ln": "LayerNorm output feeding qkv / fc1 / patch-merging reduction: inter-channel variation",
    "post_softmax": "attention probabilities per head: power-law",
    "post_gelu": "GELU output feeding fc2: asymmetric, long positive tail",
    "q": "queries (operand of q·kᵀ)",
    "k": "keys (operand of q·kᵀ)",
    "v": "values (operand of attn·v)",
    "attn_proj_in": "attention output feeding the output projection",
    "residual": "block output (residual stream): massive activations",
    "linear_in": "input of a Linear/Conv no other site covers (head, patch embed)",
    "weight": "weight of a Linear or the patch-embedding convolution",
}


@dataclass(frozen=True)
class Site:
    """One quantizable tensor. ``port``: 'output' / 'input' of ``module``, 'weight', or
    'consumers': observed at the module's output but quantized at the inputs of its
    ``consumers`` (post-LN transformers, where the LN output is also the residual stream)."""

    name: str
    kind: str
    module: str
    port: str = "output"
    consumers: tuple[str, ...] = field(default=())  # Linear modules that read this tensor
    block: int | None = None  # running block index, for per-block views

    @property
    def is_activation(self) -> bool:
        return self.port != "weight"


def _is_block(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("norm1", "attn", "norm2", "mlp"))


def _is_mlp(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("fc1", "act", "fc2")) and isinstance(m.fc2, nn.Linear)


def _is_patch_merging(m: nn.Module) -> bool:
    return isinstance(getattr(m, "norm", None), nn.LayerNorm) and isinstance(getattr(m, "reduction", None), nn.Linear)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


Rule = Callable[[str, nn.Module], list[Site]]


def _attention_rule(path: str, m: nn.Module) -> list[Site]:
    if type(m) not in TAPPED.values():
        return []
    return [
        Site(_join(path, "q"), "q", _join(path, "q")),
        Site(_join(path, "k"), "k", _join(path, "k")),
        Site(_join(path, "v"), "v", _join(path, "v")),
        Site(_join(path, "softmax"), "post_softmax", _join(path, "softmax"), consumers=(_join(path, "v"),)),
        Site(_join(path, "proj_in"), "attn_proj_in", _join(path, "proj_in"), consumers=(_join(path, "proj"),)),
    ]


def _block_rule(path: str, m: nn.Module) -> list[Site]:
    if not _is_block(m):
        return []
    return [
        Site(_join(path, "norm1"), "post_ln", _join(path, "norm1"), consumers=(_join(path, "attn.qkv"),)),
        Site(_join(path, "norm2"), "post_ln", _join(path, "norm2"), consumers=(_join(path, "mlp.fc1"),)),
        Site(path, "residual", path),
    ]


def _mlp_rule(path: str, m: nn.Module) -> list[Site]:
    if not _is_mlp(m):
        return []
    return [Site(_join(path, "act"), "post_gelu", _join(path, "act"), consumers=(_join(path, "fc2"),))]


def _merging_rule(path: str, m: nn.Module) -> list[Site]:
    if not _is_patch_merging(m):
        return []
    return [Site(_join(path, "norm"), "post_ln", _join(path, "norm"), consumers=(_join(path, "reduction"),))]


#: Structural rules of timm ViT/DeiT/Swin; other families pass their own (see vizq.family).
RULES: list[Rule] = [_attention_rule, _block_rule, _mlp_rule, _merging_rule]


def discover_sites(model: nn.Module, extra: Iterable[Rule] = ()) -> list[Site]:
    """Every site of ``model`` (instrumented first), in network order. ``extra``: a model
    family's own rules, applied after the ViT/Swin ones."""
    rules = [*RULES, *extra]
    modules = list(model.named_modules())
    order = {name: i for i, (name, _) in enumerate(modules)}
    found: list[tuple[float, Site]] = []
    for path, m in modules:
        for rule in rules:
            for i, s in enumerate(rule(path, m)):
                # taps are registered after the attention's own children: keep the rule's order
                key = order[path] + (i + 1) / 100 if rule is _attention_rule else order.get(s.module, order[path])
                if s.kind == "residual":  # after everything inside the block
                    key = max(i for n, i in order.items() if n == s.module or n.startswith(s.module + ".")) + 0.5
                found.append((key, s))
    covered = {c for _, s in found for c in s.consumers}
    for path, m in modules:
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            found.append((order[path] + 0.1, Site(f"{path}.weight", "weight", path, port="weight", consumers=(path,))))
            if path not in covered:
                found.append((order[path] - 0.1, Site(f"{path}:input", "linear_in", path, port="input", consumers=(path,))))
    found.sort(key=lambda t: t[0])
    sites = [s for _, s in found]
    return _number_blocks(sites)


def _number_blocks(sites: list[Site]) -> list[Site]:
    """Give each site the running index of the residual block it belongs to."""
    residuals = [s.name for s in sites if s.kind == "residual"]
    out = []
    for s in sites:
        idx = next((i for i, r in enumerate(residuals) if s.name == r or s.name.startswith(r + ".")), None)
        out.append(Site(s.name, s.kind, s.module, s.port, s.consumers, idx))
    return out


def select_sites(sites: Iterable[Site], pattern: str | None = None, kinds: Iterable[str] | None = None) -> list[Site]:
    """Filter by glob(s) (comma-separated, e.g. ``blocks.*.attn.softmax``) and/or kinds."""
    sites = list(sites)
    if kinds is not None:
        kinds = list(kinds)
        bad = [k for k in kinds if k not in KINDS]
        if bad:
            raise InputError(f"unknown site kind(s) {bad}; kinds are: {', '.join(KINDS)}")
        sites = [s for s in sites if s.kind in kinds]
    if pattern:
        pats = [p.strip() for p in pattern.split(",") if p.strip()]
        sites = [s for s in sites if any(fnmatch.fnmatchcase(s.name, p) for p in pats)]
    return sites


def find_site(sites: Iterable[Site], name: str) -> Site:
    sites = list(sites)
    for s in sites:
        if s.name == name:
            return s
    close = close_names(name, [s.name for s in sites])
    hint = f"; similar: {', '.join(close)}" if close else ""
    raise InputError(f"no site named {name!r}{hint}. List them with `python -m vizq sites --model …`")


def close_names(name: str, names: list[str], n: int = 5) -> list[str]:
    """Site names that look like ``name`` (a typo, or a glob with one part wrong), for hints."""
    import difflib

    plain = name.replace("*", "0").replace("?", "0")
    close = difflib.get_close_matches(plain, names, n=n, cutoff=0.6)
    return close or [s for s in names if name.split(".")[-1].strip("*?") and name.split(".")[-1].strip("*?") in s][:n]


def count_by_kind(sites: Iterable[Site]) -> dict[str, int]:
    out = {k: 0 for k in KINDS}
    for s in sites:
        out[s.kind] += 1
    return {k: v for k, v in out.items() if v}
