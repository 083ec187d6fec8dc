"""`validate()`: check that the packed path actually selected reproduces stock Hugging Face.

Gates, in order: architecture and config flags, module structure, device capability, the kernel
toolchain (when fused kernels are selected), then numerics on one ragged padded batch that mixes right-
and left-padded rows with lengths past the local window (``1, w+1, 2w+2, 8w+1, 32w+1`` for half window
``w``: 1, 65, 130, 513, 2049 for ModernBERT; on CPU ``1, w+1, 2w+2, 4w+1`` to keep it to seconds).
The stock forward is run with ``position_ids`` restarting at each row's first real token, the packed
convention. Per-token cosine over real tokens (min and mean) and the worst per-token relative error
``||fast - stock|| / ||stock||`` are reported; thresholds: bf16/fp16 min >= 0.995 and mean >= 0.999; fp32 max
relative error <= 1e-4; past that, the packed path must be within 2x stock fp32's own error against an fp64
run of stock (cuBLAS picks other reduction orders for the unpadded GEMM shapes: 1.3e-4 to 2.4e-4 measured
packed-vs-stock through 22 to 28 random-init fp32 layers on the H200).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .adapters.fsdp import gathered
from .adapters.structure import structure_check
from .batch import unpad
from .call import run_packed
from .configure import encoder_states
from .errors import PackedEncodersError, ValidationError
from .model.calls import is_called

BF16_COS_MIN = 0.995
BF16_COS_MEAN = 0.999
FP32_MAX_REL = 1e-4


@dataclass
class EncoderReport:
    path: str
    model_type: str
    device: str
    dtype: str
    kernels: str
    attention: dict
    lengths: tuple
    cos_min: float = float("nan")
    cos_mean: float = float("nan")
    max_rel_err: float = float("nan")
    checks: list = field(default_factory=list)
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass
class ValidationReport:
    """Result of :func:`validate`: one :class:`EncoderReport` per ModernBERT encoder found."""

    encoders: list

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.encoders)

    def summary(self) -> str:
        lines = []
        for e in self.encoders:
            status = "ok" if e.passed else "FAILED: " + "; ".join(e.failures)
            head = (f"[{e.path or 'encoder'}] {e.model_type} {e.dtype} on {e.device}, kernels={e.kernels}, "
                    f"attention={e.attention}, lengths={list(e.lengths)}")
            if math.isnan(e.cos_min) and not e.passed:  # the packed path never produced an output: the reason first
                lines.append(f"{head} -> {status}")
                continue
            lines.append(f"{head}: per-token cosine min {e.cos_min:.6f} mean {e.cos_mean:.6f}, max rel err "
                         f"{e.max_rel_err:.2e} ({e.seconds:.2f} s) -> {status}")
        return "\n".join(lines)


def _lengths(window: int, device: torch.device) -> tuple[int, ...]:
    w = max(int(window), 1)
    if device.type == "cuda":
        return (1, w + 1, 2 * w + 2, 8 * w + 1, 32 * w + 1)
    return (1, w + 1, 2 * w + 2, 4 * w + 1)  # CPU: past the window twice over, in seconds


def _within_envelope(lengths, requested: str, params, dtype, device) -> tuple[int, ...]:
    """An explicitly requested backend is checked on the lengths it accepts (e.g. the Triton kernel's
    ``max_seqlen`` cap); calls outside them raise at run time rather than fall back."""
    from .attention.backends import BACKENDS, Workload

    backend = BACKENDS.get(requested)
    if backend is None:
        return tuple(lengths)
    kept = tuple(n for n in lengths if backend.envelope(Workload(
        num_seqs=1, total_tokens=n, max_seqlen=n, heads=params.num_attention_heads, head_dim=params.head_dim,
        window=None, grad=False, dtype=dtype, device_type=device.type)) is None)
    return kept or tuple(lengths)


def _fp64_yardstick(model, ids, mask, positions, fast, stock) -> tuple[float, float]:
    """``(packed vs fp64, stock fp32 vs fp64)`` worst per-token relative errors, from an fp64 copy of the model.

    Used when fp32 packed and fp32 stock differ by more than 1e-4: on CUDA, cuBLAS picks other reduction orders
    for the unpadded GEMM shapes, and through a deep random-init stack both fp32 paths drift by ~1e-4 from the
    exact result (measured 1.3e-4 to 2.4e-4 packed-vs-stock at ModernBERT-base / -large geometry on the H200).
    The packed path passes when it is as close to fp64 as stock fp32 itself (DESIGN's 2x rule).
    """
    import copy

    twin = copy.deepcopy(model).double()
    twin.__dict__.pop("forward", None)  # the copy runs the class (stock) forward
    twin.__dict__.pop("_packed_encoders", None)
    exact = _stock_forward(twin, input_ids=ids, attention_mask=mask, position_ids=positions,
                           return_dict=True).last_hidden_state
    del twin
    real = mask.bool()
    ref = exact[real]
    return rel_err(fast[real].double(), ref), rel_err(stock[real].double(), ref)


def check_batch(lengths, vocab_size: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids ``[B, S]`` and a 0/1 mask with one row per length: even rows right-padded, odd rows left-padded."""
    gen = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(lengths)
    ids = torch.randint(0, vocab_size, (b, s), generator=gen)
    mask = torch.zeros(b, s, dtype=torch.long)
    for row, n in enumerate(lengths):
        if row % 2:
            mask[row, s - n:] = 1
        else:
            mask[row, :n] = 1
    return ids.to(device), mask.to(device)


def rel_err(a: torch.Tensor, r: torch.Tensor) -> float:
    """Worst per-token ``||a - r|| / ||r||`` over rows of ``[N, H]``."""
    return float(((a - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)).max()) if a.numel() else 0.0


def check_structure(model: nn.Module, params) -> list[str]:
    """Module shapes and flags against the config; returns the mismatches (empty when consistent). A projection slot
    holding a module the packed forward calls (not an ``nn.Linear``: a peft LoRA layer, a wrapped Linear) is left to
    the structure check (its declared widths) and to each call (its output width): its weight and bias, if any, are
    its own business."""
    problems = []
    h, i3 = params.hidden_size, 3 * params.hidden_size
    if len(model.layers) != params.num_hidden_layers:
        problems.append(f"{len(model.layers)} layers but config.num_hidden_layers={params.num_hidden_layers}")
    for idx, layer in enumerate(model.layers):
        shapes = {
            "attn.Wqkv": (layer.attn.Wqkv, (i3, h)),
            "attn.Wo": (layer.attn.Wo, (h, h)),
            "mlp.Wi": (layer.mlp.Wi, (2 * params.intermediate_size, h)),
            "mlp.Wo": (layer.mlp.Wo, (h, params.intermediate_size)),
        }
        for name, (m, want) in shapes.items():
            if not is_called(m) and tuple(m.weight.shape) != want:
                problems.append(f"layers[{idx}].{name} weight {tuple(m.weight.shape)} != {want}")
        wqkv, wi = layer.attn.Wqkv, layer.mlp.Wi
        if not is_called(wqkv) and (wqkv.bias is not None) != params.attention_bias:
            problems.append(f"layers[{idx}].attn.Wqkv bias presence disagrees with attention_bias")
        if not is_called(wi) and (wi.bias is not None) != params.mlp_bias:
            problems.append(f"layers[{idx}].mlp.Wi bias presence disagrees with mlp_bias")
        attention_type = getattr(layer, "attention_type", None)
        if attention_type is not None and (attention_type == "full_attention") != params.layer_is_global[idx]:
            problems.append(f"layers[{idx}].attention_type={attention_type!r} disagrees with the config")
        if idx == 0 and not isinstance(layer.attn_norm, nn.Identity) and not isinstance(layer.attn_norm, nn.LayerNorm):
            problems.append("layers[0].attn_norm is neither Identity nor LayerNorm")
    return problems


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block, then every submodule back in its own train / eval mode:
    ``model.train(was)`` would set them all alike, switching off Monte-Carlo dropout (an eval model with its dropout
    modules in train mode) or switching on dropout in a part the caller keeps in eval."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _stock_forward(model: nn.Module, **kwargs):
    return type(model).forward(model, **kwargs)


def parity(a: torch.Tensor, r: torch.Tensor) -> tuple[float, float, float, bool]:
    """``(cosine min, cosine mean, max relative error, all finite)`` of packed real tokens ``a`` against stock's
    ``r`` (both ``[N, H]`` fp32). The relative error is per token ``||a - r|| / ||r||``, the worst token: one
    large-magnitude feature cannot hide it (as max|diff| / max|stock| would) and one tiny token cannot inflate it."""
    cos = torch.nn.functional.cosine_similarity(a, r, dim=-1, eps=1e-12)
    return float(cos.min()), float(cos.mean()), rel_err(a, r), bool(torch.isfinite(a).all())


@torch.no_grad()
def check_encoder(model: nn.Module, state, path: str = "", lengths=None, seed: int = 0) -> EncoderReport:
    """Run every gate on one encoder with the options in ``state`` (installed or not)."""
    params = state.params
    weight = model.embeddings.tok_embeddings.weight
    device, dtype = weight.device, weight.dtype
    if lengths is not None:
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
            raise PackedEncodersError(f"validation lengths {lengths!r}: expected a non-empty list of positive ints "
                                      "(real tokens per row)")
        raw = tuple(lengths)
        if not raw or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in raw):
            raise PackedEncodersError(f"validation lengths {list(raw)!r}: expected a non-empty list of "
                                      "positive ints (real tokens per row)")
        lengths = tuple(int(n) for n in raw)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and max(lengths) > limit:
            raise PackedEncodersError(f"validation lengths reach {max(lengths)} tokens, past the model's "
                                      f"max_position_embeddings ({limit})")
    lengths = lengths if lengths is not None else _within_envelope(
        _lengths(params.window, device), state.options.attention_backend, params, dtype, device)
    report = EncoderReport(path=path, model_type=params.model_type, device=str(device),
                           dtype=str(dtype).replace("torch.", ""), kernels=state.ops.name, attention={},
                           lengths=lengths)
    report.checks.append("config: ModernBertParams read")
    problems = check_structure(model, params)
    report.failures += problems
    live = None if problems else structure_check(model, state)
    if live is not None:
        report.failures.append(f"packed path raised: the packed forward cannot run this model: {live}")
    report.checks.append("structure")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        report.checks.append(f"device: {torch.cuda.get_device_name(device)} sm_{major}{minor}")
        if dtype == torch.bfloat16 and major < 8:
            report.failures.append(f"bf16 needs sm_80 or newer (got sm_{major}{minor})")
    smoke = getattr(state.ops, "smoke", None)
    if smoke is not None:
        try:
            smoke(device)
            gemms = " and quack GEMMs" if state.ops.gemm == "quack" else ""
            report.checks.append(f"toolchain: {state.ops.name} kernels{gemms} compiled and ran")
        except Exception as exc:  # a broken toolchain must not pass silently
            hint = ("" if state.ops.gemm != "quack" else
                    " (PACKED_ENCODERS_QUACK_GEMM=0 keeps the GEMMs on cuBLAS if quack's are the cause)")
            report.failures.append(f"kernel toolchain ({state.ops.name}) failed: {exc.__class__.__name__}: {exc}{hint}")
    if report.failures:
        return report

    t0 = time.perf_counter()
    # the rows of the embedding, as calls are checked against (config.vocab_size may say more: ids past the rows
    # would fail stock's own lookup here, where a call's real ids never reach them)
    vocab_size = model.embeddings.tok_embeddings.num_embeddings
    ids, mask = check_batch(lengths, vocab_size, device, seed)
    b, s = ids.shape
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with eval_mode(model):
        try:
            stock = _stock_forward(model, input_ids=ids, attention_mask=mask, position_ids=positions,
                                   return_dict=True).last_hidden_state
            batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None,
                          token_type_ids=None, vocab_size=vocab_size, fused=state.tuning.fused_unpad)
            fast = batch.pad(run_packed(model, state, batch))
            # quack GEMMs engage from thousands of tokens and the check batch is short: check it again with them
            # forced on, so both the path short calls take and the one long calls take are held to the bars below
            forced = None
            if state.ops.gemm == "quack" and dtype != torch.float32:  # fp32 never takes quack
                from .ops.quack_gemm import forced as quack_forced

                with quack_forced():
                    forced = batch.pad(run_packed(model, state, batch))
            fp64_err = None
            if dtype == torch.float32 and rel_err(fast[mask.bool()].float(),
                                                  stock[mask.bool()].float()) > FP32_MAX_REL:
                fp64_err = _fp64_yardstick(model, ids, mask, positions, fast, stock)
        except PackedEncodersError as exc:
            report.failures.append(f"packed path raised: {exc}")
            return report
    report.attention = dict(state.last_plan)
    real = mask.bool()
    r = stock[real].float()
    report.cos_min, report.cos_mean, report.max_rel_err, finite = parity(fast[real].float(), r)
    if forced is not None:  # the worse of the two runs
        cos_min, cos_mean, max_rel_err, finite_f = parity(forced[real].float(), r)
        report.cos_min = min(report.cos_min, cos_min)
        report.cos_mean = min(report.cos_mean, cos_mean)
        report.max_rel_err = max(report.max_rel_err, max_rel_err)
        finite = finite and finite_f
        report.checks.append("numerics also with the quack GEMMs forced on every projection they serve")
    report.seconds = time.perf_counter() - t0
    stock_finite = bool(torch.isfinite(r).all())
    if not finite:
        report.failures.append("non-finite values in the packed output" if stock_finite else
                               "non-finite values in the packed output, and in stock HF's too: the model's weights "
                               "or buffers hold NaN / inf (or overflow in this dtype), not the packed path")
    elif not stock_finite:  # (nothing to compare with: the cosine and error below would only say nan)
        report.failures.append("stock HF's output holds NaN / inf at real tokens where the packed output is finite: "
                               "stock's own numerics fail on this model in this dtype (e.g. its eager attention's "
                               "masks), so the packed path cannot be checked against it; pe.pack(model, "
                               "validate=False) packs it unchecked")
        report.checks.append(f"numerics on lengths {list(lengths)} (right and left padding)")
        return report
    if dtype == torch.float32:
        if fp64_err is not None:
            ours, theirs = fp64_err
            report.checks.append(f"fp32 vs an fp64 run of stock: packed {ours:.2e}, stock {theirs:.2e}")
            if not ours <= 2 * theirs + 1e-6:
                report.failures.append(
                    f"fp32 max relative error {report.max_rel_err:.3e} > {FP32_MAX_REL:.0e}, and against fp64 the packed "
                    f"path ({ours:.2e}) is not within 2x stock fp32's own error ({theirs:.2e})")
        elif not report.max_rel_err <= FP32_MAX_REL:
            report.failures.append(f"fp32 max relative error {report.max_rel_err:.3e} > {FP32_MAX_REL:.0e}")
    else:
        if not report.cos_min >= BF16_COS_MIN:
            report.failures.append(f"per-token cosine min {report.cos_min:.6f} < {BF16_COS_MIN}")
        if not report.cos_mean >= BF16_COS_MEAN:
            report.failures.append(f"per-token cosine mean {report.cos_mean:.6f} < {BF16_COS_MEAN}")
    report.checks.append(f"numerics on lengths {list(lengths)} (right and left padding)")
    return report


def validate(target, *, lengths=None, attention_backend: str | None = None, kernels: str | None = None,
             raise_on_failure: bool = False) -> ValidationReport:
    """Validate every ModernBERT encoder inside ``target`` on the path it runs (or would run after ``pack``).

    The check runs stock HF and the packed path without dropout: ``target`` is in eval mode while it runs, and every
    module is back in its own mode after (:func:`eval_mode`). Another thread calling ``target`` meanwhile runs in
    eval mode too, and a ``train()`` / ``eval()`` it makes meanwhile is undone: validate (or ``pack`` with
    ``validate=True``) before serving or training from other threads.

    Args:
        lengths: real-token lengths of the rows of the check batch (default: past the local window, see
            the module docstring).
        attention_backend, kernels: check these options instead of the packed ones (or the defaults).
        raise_on_failure: raise :class:`ValidationError` (with the numbers) instead of returning a failed report.

    Returns:
        A :class:`ValidationReport` (``passed``, ``summary()``, one report per encoder).

    Raises:
        UnsupportedTargetError: no ModernBERT encoder inside ``target``.
        PackedEncodersError: ``lengths`` not a list of positive ints, or past ``max_position_embeddings``; an unknown
            ``attention_backend`` / ``kernels``; ``raise_on_failure`` not a bool.
        ValidationError: with ``raise_on_failure``, a failed check.
    """
    if not isinstance(raise_on_failure, bool):
        raise PackedEncodersError(f"raise_on_failure={raise_on_failure!r} must be True or False")
    reports = []
    for path, model, state in encoder_states(target, attention_backend=attention_backend, kernels=kernels):
        with gathered(target, path, model):
            reports.append(check_encoder(model, state, path, lengths))
    result = ValidationReport(reports)
    if raise_on_failure and not result.passed:
        raise ValidationError("validation against stock Hugging Face failed:\n" + result.summary(), result)
    return result
