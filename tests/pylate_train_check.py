"""Run inside the PyLate environment (tests/envs/pylate.sh): PyLate ColBERT training, packed vs stock.

For ``losses.Contrastive`` and ``losses.CachedContrastive`` (GradCache, chunks of 2), with gradient checkpointing
off and on: 3 steps of sentence-transformers' trainer with PyLate's ColBERTCollator (queries expanded with
[MASK] to ``query_length``, as PyLate trains), stock then ``pe.pack``-ed, same seed and data order. Compares the
loss of every step, every gradient before each optimizer step and the weights after (tests/training_compare.py).
Then, for each loss, the packed model on training graphs (``GraphConfig(training=True)``, the route forced as
on CUDA by tests/test_train_graphs_loops.py's ``training_route_as_on_cuda``; checkpointing off, which training
graphs refuse) against the same stock run, with the calls the training-graph node served and describe()'s entry.
Prints one JSON line per case; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1])  # the repository root

import packed_encoders as pe  # noqa: E402
from packed_encoders.graphs.config import GraphConfig  # noqa: E402
from tests.tiny_tokenizer import save_tiny_model  # noqa: E402
from tests.training_compare import LR, OPTIM, Recorder, compare, texts  # noqa: E402

STEPS, BATCH = 3, 4
# Contrastive embeds queries, positives and negatives with gradients before its one backward: three slots pending
TRAINING = GraphConfig(training=True, training_slots=3)


def colbert(path):
    from pylate import models

    torch.manual_seed(0)  # the projection is random-init: the same weights in both runs
    return models.ColBERT(model_name_or_path=path, embedding_size=32, device="cpu", query_length=16,
                          document_length=64)


def train(path, out, loss_name: str, packed: bool, checkpointing: bool, graphs: bool = False):
    """One trainer run; ``graphs``: packed with :data:`TRAINING` and the route forced (the node's call counts and
    training entry go into the returned info)."""
    from datasets import Dataset
    from pylate import losses, utils
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    model = colbert(path)
    if packed:
        pe.pack(model, cuda_graph=TRAINING if graphs else None)
    loss = (losses.Contrastive(model) if loss_name == "contrastive"
            else losses.CachedContrastive(model, mini_batch_size=2))
    rec = Recorder(loss)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(Path(out) / f"{loss_name}-{packed}-{checkpointing}-{graphs}"), per_device_train_batch_size=BATCH,
        max_steps=STEPS, learning_rate=LR, optim=OPTIM, warmup_steps=0, lr_scheduler_type="constant", seed=0,
        data_seed=0, max_grad_norm=0.0, gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, report_to=[], save_strategy="no",
        logging_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    data = texts(STEPS * BATCH, negatives=True)
    data = Dataset.from_dict({"query": data["anchor"], "positive": data["positive"], "negative": data["negative"]})
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss,
                                         data_collator=utils.ColBERTCollator(model.tokenize),
                                         callbacks=[rec.callback])
    if graphs:
        from tests.test_train_graphs_loops import _training_entry, training_route_as_on_cuda

        with training_route_as_on_cuda() as calls:
            trainer.train()
        info = {**pe.describe(model)["encoders"][0], "calls": dataclasses.asdict(calls),
                "training": _training_entry(model)}
    else:
        trainer.train()
        info = pe.describe(model)["encoders"][0]
    if packed and not (info["packed"] and info["last_attention"]):
        raise AssertionError(f"the packed path did not run: {info}")
    if model[0].auto_model.is_gradient_checkpointing != checkpointing:
        raise AssertionError("gradient checkpointing was not set as asked")
    return rec, {n: p.detach().clone() for n, p in model.named_parameters()}, info


def main() -> int:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(Path(tmp) / "model")
        initial = {n: p.detach().clone() for n, p in colbert(path).named_parameters()}
        for loss_name in ("contrastive", "cached_contrastive"):
            stock = {}  # checkpointing -> the stock run, shared by the training-graph case (checkpointing off)
            for checkpointing, graphs in ((False, False), (True, False), (False, True)):
                case = {"loss": loss_name, "checkpointing": checkpointing, "graphs": graphs}
                start = time.perf_counter()
                try:
                    if checkpointing not in stock:
                        stock[checkpointing] = train(path, tmp, loss_name, False, checkpointing)[:2]
                    ref, ref_w = stock[checkpointing]
                    got, got_w, info = train(path, tmp, loss_name, True, checkpointing, graphs)
                    result = compare(ref, got, ref_w, got_w, initial, STEPS)
                except Exception as exc:  # noqa: BLE001 - reported as JSON for the pytest side
                    print(json.dumps({**case, "error": f"{type(exc).__name__}: {exc}"[:3000],
                                      "traceback": traceback.format_exc()[-3000:]}))
                    return 1
                extra = {k: info[k] for k in ("calls", "training") if k in info}
                print(json.dumps({**case, **result, **extra, "padded_outputs": info["padded_outputs"],
                                  "unpad_syncs_skipped": info["unpad_syncs_skipped"],
                                  "attention": info["last_attention"],
                                  "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
