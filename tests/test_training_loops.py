"""Real training loops, packed vs stock: sentence-transformers' trainer with (Cached)MultipleNegativesRankingLoss.

Each case trains a tiny saved ModernBERT (no downloads) for 3 steps twice -- stock and ``pe.pack``-ed -- with the
same seed, data order and optimizer, and compares the loss of every step, every parameter gradient right
before each optimizer step, and the weights after the last step. Dropout is 0 in the tiny config, so the two
runs see identical arithmetic up to fp32 rounding. PyLate's losses run in PyLate's own environment
(tests/test_pylate.py).
"""

from __future__ import annotations

import dataclasses

import pytest

import packed_encoders as pe
from tests.helpers import is_checkpointing
from tests.tiny_tokenizer import save_tiny_model
from tests.training_compare import LR, OPTIM, Recorder, compare, texts

st = pytest.importorskip("sentence_transformers")

STEPS, BATCH = 3, 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_modernbert_train"))


def _st_model(model_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(model_dir)
    return SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                               device="cpu")


def _checkpointing_args(args_cls, on: bool) -> dict:
    """The training arguments that turn gradient checkpointing on or off (non-reentrant): ``activation_checkpointing``
    where transformers has it (``gradient_checkpointing`` is its deprecated alias there, which warns)."""
    prefix = ("activation" if "activation_checkpointing" in {f.name for f in dataclasses.fields(args_cls)}
              else "gradient")
    return {f"{prefix}_checkpointing": on, f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}


def _train(model_dir, tmp_path, loss_name: str, packed: bool, checkpointing: bool, pack_kw: dict | None = None):
    """Train for ``STEPS`` steps; returns the recorder, the final weights and the model (``pack_kw``: ``pe.pack``'s
    options when ``packed``)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer import losses

    model = _st_model(model_dir)
    if packed:
        pe.pack(model, **(pack_kw or {}))
    if loss_name == "mnrl":
        loss = losses.MultipleNegativesRankingLoss(model)
    else:  # GradCache: mini-batches of 2 (two chunks per step), several forwards before one backward
        loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    rec = Recorder(loss)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / f"out-{loss_name}-{packed}-{checkpointing}"), per_device_train_batch_size=BATCH,
        max_steps=STEPS, learning_rate=LR, optim=OPTIM, warmup_steps=0, lr_scheduler_type="constant", seed=0,
        data_seed=0, max_grad_norm=0.0, **_checkpointing_args(SentenceTransformerTrainingArguments, checkpointing),
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=Dataset.from_dict(texts(STEPS * BATCH)),
                                         loss=loss, callbacks=[rec.callback])
    trainer.train()
    if packed:
        info = pe.describe(model)["encoders"][0]
        assert info["packed"] and info["last_attention"], info  # the packed path really ran
        # GradCache's second forward of each chunk (with gradients, over the same slices) skips the unpad's sync
        assert (info["unpad_syncs_skipped"] > 0) == (loss_name == "cached_mnrl"), info["unpad_syncs_skipped"]
    assert is_checkpointing(model[0].auto_model) == checkpointing
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return rec, weights, model


def packed_matches_stock(model_dir, tmp_path, loss_name: str, checkpointing: bool = False, pack_kw: dict | None = None):
    """Train stock, then packed (``pe.pack(model, **pack_kw)``); assert the two runs agree (``compare``) and return
    the packed model."""
    ref, ref_w, _ = _train(model_dir, tmp_path, loss_name, packed=False, checkpointing=checkpointing)
    got, got_w, model = _train(model_dir, tmp_path, loss_name, packed=True, checkpointing=checkpointing,
                               pack_kw=pack_kw)
    initial = {n: p.detach().clone() for n, p in _st_model(model_dir).named_parameters()}
    compare(ref, got, ref_w, got_w, initial, STEPS)
    return model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("loss_name", ["mnrl", "cached_mnrl"])
def test_sentence_transformer_trainer_matches_stock(model_dir, tmp_path, loss_name, checkpointing):
    packed_matches_stock(model_dir, tmp_path, loss_name, checkpointing)
