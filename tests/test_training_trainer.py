"""transformers' Trainer on packed task heads vs the same run on a stock copy (same seed, data order, SGD).

Labels padded with a class id (not -100) count at padded positions. The head's own loss gets stock's values there
(tests/test_heads.py); a loss the Trainer computes outside the head (label smoothing, ``compute_loss_func``) pops
``labels`` before calling the model, so the head cannot see them: the README's way out, ``padded_outputs="all"``,
gives stock's losses and weights, and the head's own loss with the default does too.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import transformers

import packed_encoders as pe
from tests.helpers import VOCAB, make_model

pytest.importorskip("accelerate")

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3


class _Rows(torch.utils.data.Dataset):
    """Rows of 4..27 ids with per-token labels in [0, 3)."""

    def __init__(self, n=12):
        g = torch.Generator().manual_seed(0)
        self.rows = []
        for n_tok in torch.randint(4, 28, (n,), generator=g).tolist():
            self.rows.append({"input_ids": torch.randint(3, VOCAB, (n_tok,), generator=g).tolist(),
                              "labels": torch.randint(0, 3, (n_tok,), generator=g).tolist()})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _collate(rows):
    """Right padding to a multiple of 8, labels padded with class 0 (they count at padded positions)."""
    width = -(-max(len(r["input_ids"]) for r in rows) // 8) * 8
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], mask[i, :n], labels[i, :n] = torch.tensor(r["input_ids"]), 1, torch.tensor(r["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _token_loss(outputs, labels, num_items_in_batch=None):
    logits = outputs["logits"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _train(packed: bool, padded_outputs: str = "auto", **trainer_kw):
    model = make_model("tiny", cls=transformers.ModernBertForTokenClassification, num_labels=3).train()
    if packed:
        pe.pack(model, padded_outputs=padded_outputs)
    losses = []

    class Losses(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(out, per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-2,
                                              optim="sgd", logging_steps=1, report_to=[], save_strategy="no",
                                              use_cpu=True, seed=0, disable_tqdm=True,
                                              remove_unused_columns=False, **trainer_kw.pop("args", {}))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows(), data_collator=_collate,
                                       callbacks=[Losses()], **trainer_kw)
        trainer.train()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("how", ["label_smoothing", "compute_loss_func", "head_loss"])
def test_trainer_losses_at_padded_labels_are_stock(how):
    kw = {"label_smoothing": dict(args=dict(label_smoothing_factor=0.1)),
          "compute_loss_func": dict(compute_loss_func=_token_loss), "head_loss": {}}[how]
    ref_losses, ref_weights, _ = _train(False, **dict(kw))
    losses, weights, model = _train(True, "auto" if how == "head_loss" else "all", **dict(kw))
    assert len(losses) == len(ref_losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    for n in ref_weights:
        torch.testing.assert_close(weights[n], ref_weights[n], atol=1e-5, rtol=1e-5, msg=n)
    assert pe.is_packed(model)
