"""Model configs and the three model families the benchmarks run: plain HF, SentenceTransformer, ColBERT.

Random-init weights from real configs (throughput depends on geometry, not on trained values), or a local
checkpoint with ``--model PATH``. The parent process saves the random model once (``save_pretrained`` plus
a placeholder tokenizer, since sentence-transformers loads modules from a path); every variant process
loads that directory, so all variants run identical weights.

Sources of the configs (geometry fields; fields not listed keep ``ModernBertConfig()`` defaults):

* ``modernbert-base``: ``transformers.ModernBertConfig()`` defaults = answerdotai/ModernBERT-base
  config.json (hidden 768, 22 layers, 12 heads, intermediate 1152, vocab 50368, window 128).
* ``modernbert-large``: answerdotai/ModernBERT-large config.json: hidden 1024, 28 layers, 16 heads,
  intermediate 2624, global attention every 3rd layer.
* ``ettin-150m``: jhu-clsp/ettin-encoder-150m, a ModernBERT-architecture encoder (Weller et al. 2025,
  arXiv:2507.11412): hidden 768, 22 layers (model-card table), 12 heads, intermediate 1152; its RoPE
  thetas (160k global and local, as in the Ettin/mmBERT HF configs) do not change the cost.
* ``mmbert-base``: github.com/JHU-CLSP/mmBERT ``configs/mmBERT-base.yaml``: hidden 768, 22 layers,
  12 heads, intermediate 1152, vocab 256000 (Gemma 2 tokenizer), sliding window 128, global every 3rd
  layer; HF config (jhu-clsp/mmBERT-*): RoPE theta 160000 global and local, pad 0, cls/sep 1, bos 2.
  Cached ids are OLMo ids (< 50,285), valid in its vocabulary; tokenize with ``benchmarks.data
  --tokenizer PATH`` for a real mmBERT checkpoint.
* ``tiny``: CPU smoke tests only (hidden 64, 4 layers, window 32 so documents still cross it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

_ROPE_160K = {"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 160000.0}}

CONFIGS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96,
                 local_attention=32),
    "modernbert-base": {},
    "modernbert-large": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                             intermediate_size=2624, global_attn_every_n_layers=3),
    "ettin-150m": dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
                       max_position_embeddings=7999, rope_parameters=_ROPE_160K),
    "mmbert-base": dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12, intermediate_size=1152,
                        vocab_size=256000, rope_parameters=_ROPE_160K, pad_token_id=0, bos_token_id=2,
                        eos_token_id=1, cls_token_id=1, sep_token_id=1),
}

FAMILIES = ("hf", "st", "colbert")
COLBERT_DIM = 128
SEED = 0


def make_config(name: str):
    """A ``ModernBertConfig`` for one of :data:`CONFIGS`."""
    from transformers import ModernBertConfig

    if name not in CONFIGS:
        raise SystemExit(f"unknown --config {name!r}; choose from {', '.join(CONFIGS)}")
    return ModernBertConfig(**CONFIGS[name])


def _placeholder_tokenizer(config):
    """A WordLevel tokenizer with ModernBERT's special tokens at the config's ids (never used to encode:
    the benchmarks feed cached ids). sentence-transformers needs one to build its Transformer module."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    specials = {"[CLS]": config.cls_token_id, "[SEP]": config.sep_token_id, "[PAD]": config.pad_token_id,
                "[MASK]": getattr(config, "mask_token_id", None) or 50284}
    vocab, used = {}, set()
    for tok, idx in specials.items():
        if idx is not None and idx not in used:
            vocab[tok] = int(idx)
            used.add(int(idx))
    unk = next(i for i in range(config.vocab_size) if i not in used)
    vocab["[UNK]"] = unk
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    names = {k: (k if k in vocab else "[UNK]") for k in specials}
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", cls_token=names["[CLS]"],
                                   sep_token=names["[SEP]"], pad_token=names["[PAD]"],
                                   mask_token=names["[MASK]"], model_max_length=config.max_position_embeddings)


def save_random_model(config_name: str, out_dir: Path, dtype: torch.dtype) -> Path:
    """Random-init ``ModernBertModel`` (seed 0) saved with a placeholder tokenizer; returns ``out_dir``."""
    from transformers import ModernBertModel

    config = make_config(config_name)
    torch.manual_seed(SEED)
    model = ModernBertModel(config).to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    _placeholder_tokenizer(config).save_pretrained(out_dir)
    return out_dir


def config_summary(config) -> dict:
    """The geometry facts that set the cost, for result rows."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
            "local_attention", "global_attn_every_n_layers", "pad_token_id")
    out = {k: getattr(config, k, None) for k in keys}
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        out["global_layers"] = sum(t == "full_attention" for t in layer_types)
    return out


# --------------------------------------------------------------------------------------- families

@dataclass
class Family:
    """One model family built around a ModernBertModel.

    Attributes:
        name: ``hf`` / ``st`` / ``colbert``.
        impl: what implements it (``transformers.ModernBertModel``, ``sentence_transformers ...``).
        target: the object a user would hold and pass to ``pe.pack`` (model, SentenceTransformer, ...).
        encoder: the ``ModernBertModel`` inside.
        padded: ``(input_ids [B, S], attention_mask [B, S]) -> (tokens [B, S, D], pooled [B, D] | None)``,
            the family's real forward (the timed work; ``pooled`` is what the family returns per text).
        head: ``tokens [T, H] -> tokens [T, D]`` applied after the encoder on the packed path.
        pooled_from_packed: whether the family pools (mean) on the packed path.
    """

    name: str
    impl: str
    target: nn.Module
    encoder: nn.Module
    padded: Callable
    head: Callable
    pools: bool
    notes: list = field(default_factory=list)


def _load_hf(path: str, attn: str, dtype: torch.dtype, device: str):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, attn_implementation=attn, dtype=dtype, local_files_only=True)
    if type(model).__name__ != "ModernBertModel":
        model = getattr(model, "model", model)
    return model.to(device).eval()


def _st_transformer(path: str, attn: str, dtype: torch.dtype):
    from sentence_transformers.sentence_transformer.modules import Transformer

    return Transformer(path, model_kwargs={"attn_implementation": attn, "dtype": dtype, "local_files_only": True},
                       processor_kwargs={"local_files_only": True}, unpad_inputs=False)


def _encoder_of(target: nn.Module) -> nn.Module:
    from packed_encoders.adapters.locate import find_encoders

    return find_encoders(target)[0][1]


def build_family(name: str, path: str, attn: str, dtype: torch.dtype, device: str) -> Family:
    """Load the family ``name`` from the model directory ``path`` with HF attention ``attn``."""
    torch.manual_seed(SEED)  # the ColBERT projection is random-init: same weights in every process
    if name == "hf":
        model = _load_hf(path, attn, dtype, device)

        def padded(ids, mask):
            return model(input_ids=ids, attention_mask=mask).last_hidden_state, None

        return Family("hf", "transformers.ModernBertModel", model, model, padded, lambda x: x, False)

    if name == "st":
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import Pooling

        tr = _st_transformer(path, attn, dtype)
        st = SentenceTransformer(modules=[tr, Pooling(tr.get_embedding_dimension(), "mean")], device=device)
        st.to(device=device, dtype=dtype).eval()

        def padded(ids, mask):
            out = st({"input_ids": ids, "attention_mask": mask})
            return out["token_embeddings"], out["sentence_embedding"]

        return Family("st", "sentence_transformers.SentenceTransformer(Transformer, Pooling(mean))", st,
                      _encoder_of(st), padded, lambda x: x, True)

    if name == "colbert":
        return _build_colbert(path, attn, dtype, device)
    raise SystemExit(f"unknown family {name!r}; choose from {', '.join(FAMILIES)}")


def _build_colbert(path: str, attn: str, dtype: torch.dtype, device: str) -> Family:
    """ColBERT: ModernBERT + bias-free ``hidden -> 128`` projection, L2-normalized token vectors.

    PyLate's ``ColBERT`` when it imports (untested here: no PyLate in our environments), otherwise
    sentence-transformers v6's ``MultiVectorEncoder(Transformer, Dense(bias=False, identity))``.
    """
    notes = []
    try:
        from pylate import models as pylate_models

        model = pylate_models.ColBERT(model_name_or_path=path, embedding_size=COLBERT_DIM, device=device,
                                      model_kwargs={"attn_implementation": attn, "dtype": dtype})
        impl = f"pylate.models.ColBERT ({COLBERT_DIM})"
        dense = None
    except Exception as exc:  # noqa: BLE001 - any failure falls back, with the reason recorded
        notes.append(f"PyLate not used ({exc.__class__.__name__}: {str(exc)[:120]})")
        from sentence_transformers import MultiVectorEncoder
        from sentence_transformers.sentence_transformer.modules import Dense

        tr = _st_transformer(path, attn, dtype)
        dense = Dense(tr.get_embedding_dimension(), COLBERT_DIM, bias=False, activation_function=None,
                      module_input_name="token_embeddings")
        model = MultiVectorEncoder(modules=[tr, dense], device=device)
        impl = f"sentence_transformers.MultiVectorEncoder(Transformer, Dense({COLBERT_DIM}, bias=False))"
    model.to(device=device, dtype=dtype).eval()
    if dense is None:  # PyLate: its Dense is the last module with a linear layer
        dense = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    linear = dense.linear if hasattr(dense, "linear") else dense

    def padded(ids, mask):
        out = model({"input_ids": ids, "attention_mask": mask})
        return F.normalize(out["token_embeddings"], dim=-1), None

    def head(x):
        return F.normalize(F.linear(x, linear.weight, linear.bias), dim=-1)

    return Family("colbert", impl, model, _encoder_of(model), padded, head, False, notes)


def pad_token_id(family: Family) -> int:
    pad = family.encoder.config.pad_token_id
    return int(pad) if pad is not None else 0


def model_dir_for(args, workdir: Path, dtype: torch.dtype) -> tuple[str, str]:
    """``(path, label)``: ``--model PATH`` as is, else a random model of ``--config`` saved under ``workdir``."""
    if args.model:
        if not os.path.isdir(args.model):
            raise SystemExit(f"--model {args.model} is not a local directory (no network on the GPU machine)")
        return args.model, f"local:{os.path.basename(os.path.normpath(args.model))}"
    return str(save_random_model(args.config, workdir / f"model-{args.config}", dtype)), f"random:{args.config}"
