"""Real training loops, packed vs stock: sentence-transformers' trainer with (Cached)MultipleNegativesRankingLoss.

Each case trains a tiny saved ModernBERT (no downloads) for 3 steps twice -- stock and ``pe.pack``-ed -- with the
same seed, data order and optimizer, and compares the loss of every step, every parameter gradient right
before each optimizer step, and the weights after the last step. Dropout is 0 in the tiny config, so the two
runs see identical arithmetic up to fp32 rounding. PyLate's losses run in PyLate's own environment
(tests/test_pylate.py).
"""

from __future__ import annotations

import pytest
import torch

import packed_encoders as pe
from tests.tiny_tokenizer import TEXTS, WORDS, save_tiny_model

st = pytest.importorskip("sentence_transformers")

STEPS, BATCH = 3, 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: extra threads only contend on a shared CI machine (3x slower there with the default)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_modernbert_train"))


def _pairs(n: int = STEPS * BATCH) -> dict:
    """Anchor / positive texts of varied lengths (1-40 words), deterministic."""
    g = torch.Generator().manual_seed(0)
    anchors, positives = [], []
    for i in range(n):
        a = torch.randint(len(WORDS), (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        p = torch.randint(len(WORDS), (int(torch.randint(5, 40, (1,), generator=g)),), generator=g)
        anchors.append(" ".join(WORDS[j] for j in a.tolist()))
        positives.append(TEXTS[i % len(TEXTS)] + " " + " ".join(WORDS[j] for j in p.tolist()))
    return {"anchor": anchors, "positive": positives}


class _Recorder:
    """Loss of each step (forward hook on the loss module) and gradients right before each optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        self.losses, self.grads = [], []
        rec = self

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                rec.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                  if p.grad is not None})

        self.callback = Callback()

    def hook(self, module, inputs, output):
        self.losses.append(float(output.detach()))


def _train(model_dir, tmp_path, loss_name: str, packed: bool, checkpointing: bool):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

    transformer = Transformer(model_dir)
    model = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                                device="cpu")
    if packed:
        pe.pack(model)
    if loss_name == "mnrl":
        loss = losses.MultipleNegativesRankingLoss(model)
    else:  # GradCache: mini-batches of 2 (two chunks per step), several forwards before one backward
        loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    rec = _Recorder()
    loss.register_forward_hook(rec.hook)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / f"out-{loss_name}-{packed}-{checkpointing}"), per_device_train_batch_size=BATCH,
        max_steps=STEPS, learning_rate=1e-3, warmup_steps=0, lr_scheduler_type="constant", seed=0, data_seed=0,
        max_grad_norm=0.0, gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, report_to=[], save_strategy="no",
        logging_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=Dataset.from_dict(_pairs()), loss=loss,
                                         callbacks=[rec.callback])
    trainer.train()
    if packed:
        info = pe.describe(model)["encoders"][0]
        assert info["packed"] and info["last_attention"], info  # the packed path really ran
    assert model[0].auto_model.is_gradient_checkpointing == checkpointing
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return rec, weights


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("loss_name", ["mnrl", "cached_mnrl"])
def test_sentence_transformer_trainer_matches_stock(model_dir, tmp_path, loss_name, checkpointing):
    ref, ref_w = _train(model_dir, tmp_path, loss_name, packed=False, checkpointing=checkpointing)
    got, got_w = _train(model_dir, tmp_path, loss_name, packed=True, checkpointing=checkpointing)
    # the cached loss's hook fires once per step too (its forward returns the loss; the cached backward follows)
    assert len(ref.losses) == len(got.losses) == STEPS
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), atol=1e-5, rtol=1e-5)
    assert len(ref.grads) == len(got.grads) == STEPS
    for step, (g, r) in enumerate(zip(got.grads, ref.grads)):
        assert set(g) == set(r) and len(r) > 10
        for n in r:
            torch.testing.assert_close(g[n], r[n], atol=1e-5, rtol=1e-3, msg=f"step {step}: {n}")
    # AdamW moves every weight by ~lr per step whatever the gradient's size, so a 1e-7 gradient difference on a
    # near-zero gradient entry can move a weight by ~1e-5 (the three updates total ~3e-3)
    for n in ref_w:
        torch.testing.assert_close(got_w[n], ref_w[n], atol=5e-5, rtol=1e-4, msg=n)
    assert any((ref_w[n] - w).abs().max() > 1e-4 for n, w in _initial(model_dir).items())  # it did train


def _initial(model_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(model_dir)
    model = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                                device="cpu")
    return {n: p.detach().clone() for n, p in model.named_parameters()}
