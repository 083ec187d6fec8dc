"""Shared by the training-loop tests (our environment and PyLate's): record a trainer run, compare two runs.

Imports only torch and transformers, so tests/pylate_train_check.py can use it inside PyLate's environment.
"""

from __future__ import annotations

import torch

from tests.tiny_tokenizer import TEXTS, WORDS

# The trainers run plain SGD: AdamW moves an entry whose gradient sits near its eps by up to ~lr whatever the
# gradient's size, so gradients that agree to ~1e-5 (fp32, another summation order) left 1-2 of 12,288 Wqkv
# entries ~1e-4 apart after 3 steps, and the next steps' gradients apart with them (seen when the trainer's
# dependencies were updated). Under SGD a weight moves by lr times its gradient: differences stay lr times the
# gradients'.
OPTIM = "sgd"
LR = 1e-3
WEIGHT_ATOL = 5e-6


def texts(n: int, negatives: bool = False) -> dict[str, list[str]]:
    """``n`` anchor / positive (/ negative) texts of varied lengths: anchors 1-11 words, documents 6-50 words."""
    g = torch.Generator().manual_seed(0)

    def words(lo, hi):
        picks = torch.randint(len(WORDS), (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)
        return " ".join(WORDS[j] for j in picks.tolist())

    out = {"anchor": [words(1, 12) for _ in range(n)],
           "positive": [TEXTS[i % len(TEXTS)] + " " + words(5, 40) for i in range(n)]}
    if negatives:
        out["negative"] = [words(5, 50) for _ in range(n)]
    return out


class Recorder:
    """Loss of each step (a forward hook on the loss module) and every parameter's gradient right before each
    optimizer step (a trainer callback; ``max_grad_norm=0`` leaves them unclipped)."""

    def __init__(self, loss_module: torch.nn.Module):
        from transformers import TrainerCallback

        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        rec = self

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                rec.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                  if p.grad is not None})

        self.callback = Callback()
        loss_module.register_forward_hook(lambda module, inputs, output: self.losses.append(float(output.detach())))


def compare(ref: Recorder, got: Recorder, ref_weights: dict, got_weights: dict, initial: dict, steps: int) -> dict:
    """Raise ``AssertionError`` naming the step / parameter where ``got`` differs from ``ref``; else return the
    largest differences seen (losses, gradients relative to the gradient's scale, weights)."""
    assert len(ref.losses) == len(got.losses) == steps, (ref.losses, got.losses)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), atol=1e-5, rtol=1e-5)
    assert len(ref.grads) == len(got.grads) == steps
    worst_grad = 0.0
    for step, (g, r) in enumerate(zip(got.grads, ref.grads)):
        assert set(g) == set(r) and len(r) > 10, (sorted(set(g) ^ set(r)), len(r))
        for n in r:
            torch.testing.assert_close(g[n], r[n], atol=1e-5, rtol=1e-3,
                                       msg=lambda m, n=n, s=step: f"step {s}: {n}: {m}")
            worst_grad = max(worst_grad, float((g[n] - r[n]).abs().max()))
    worst_weight = 0.0
    for n in ref_weights:
        torch.testing.assert_close(got_weights[n], ref_weights[n], atol=WEIGHT_ATOL, rtol=1e-4, msg=n)
        worst_weight = max(worst_weight, float((got_weights[n] - ref_weights[n]).abs().max()))
    moved = max(float((ref_weights[n] - w).abs().max()) for n, w in initial.items())
    assert moved > 1e-4, "the weights did not move: nothing was trained"
    return {"losses": ref.losses, "max_loss_diff": max(abs(a - b) for a, b in zip(ref.losses, got.losses)),
            "max_grad_diff": worst_grad, "max_weight_diff": worst_weight, "max_weight_update": moved}
