"""Route the encoder's projections to quack's CuteDSL GEMMs where they beat cuBLAS (forwards without gradient).

Measured on the H200 (``benchmarks/gemm_epilogue.py``, bf16, CUDA-graph GPU time, 2026-11-29, quack 0.6.5):

- ``Wi`` with the GLU in the GEMM epilogue (:mod:`.cute.gemm`) against cuBLAS + the Triton GLU kernel:
  ModernBERT-base 1.13x at 1,024 tokens, 1.19x at 2,048, 1.47x at 4,096, 1.47x at 7,424, 1.53x at 16k,
  1.40x at 123k; ModernBERT-large 1.46x at 7,424, 1.40x at 123k; 0.68-0.83x at 256-512 tokens. Hence
  :data:`GLU_MIN_TOKENS`.
- ``Wqkv`` with RoPE in the epilogue (q, k) plus a plain GEMM for v, against quack's plain ``Wqkv`` GEMM and the
  separate RoPE pass: 1.20x at 4,096 tokens, 1.21x at 7,424, 1.16x at 16,384, 1.14x at 122,880 (H200,
  ``benchmarks/gemm_epilogue.py --ops rope``). In the forward: indexing b128 +1.3-4.9 %, documents b8 with graphs
  +3.7-7.4 % (in-process A/B). Not measured below 4,096 tokens, hence :data:`ROPE_MIN_TOKENS` (in graphs; the
  eager rule is the plain projections' one, where quack's extra host time per launch stops mattering).
- Plain projections (quack's ``gemm``, its default config) against cuBLAS ``F.linear``: shape-dependent, so
  only the measured winners are in :data:`LINEAR_MIN_TOKENS`. Base ``Wqkv`` (2304 x 768) 1.08x at 7,424 and
  1.11x at 123k; ``attn.Wo`` (768 x 768) 1.12x / 1.32x; ``mlp.Wo`` (768 x 1152) 1.07x / 1.14x; at 4,096
  tokens 1.13x / 1.03x / 1.02x; 0.4-0.7x below 2,048. Large ``Wqkv`` (3072 x 1024) 1.06x / 1.04x,
  ``attn.Wo`` (1024 x 1024) 0.88x / 1.16x, ``mlp.Wo`` (1024 x 2624) 0.90x / 0.91x (never routed).

A quack launch costs ~10-20 us more host time than cuBLAS's, which an eager forward of a few thousand tokens
pays (it is host-bound there); inside a CUDA-graph capture only GPU time counts. So plain projections take
quack from ``graph`` tokens while capturing and from ``eager`` tokens otherwise. The packed forward's plan (:mod:`packed_encoders.model.plan`)
does not consult these routes at all for eager calls below ``QUACK_EAGER_MIN_TOKENS`` (16,384) tokens, so the GLU
epilogue's :data:`GLU_MIN_TOKENS` serves graph captures and validation.

Only on sm_90 (where it was measured) and only when the whole toolchain imports. Gradient-carrying calls and
``torch.compile`` tracing stay on cuBLAS by choice (not recorded). Calls that meet the size rule but that quack
cannot take (a bias, fp32 or mixed dtypes, another device, unaligned strides or rows, an unknown activation)
stay on cuBLAS and are recorded (:func:`fallbacks`, in ``describe()["kernel_fallbacks"]``). The switches are
arguments, read by ``pack()`` (its frozen ``Tuning``) and passed when the op set is built
(:func:`with_quack_gemms`, :func:`unavailable`), never read here: ``PACKED_ENCODERS_QUACK_GEMM=0`` keeps the
projections on cuBLAS (quack is then not even imported), ``PACKED_ENCODERS_QUACK_ROPE=0`` turns off only the
RoPE epilogue on the q, k projection; a change takes effect at the next ``pe.pack(model)``, graphs included.
Importing this module imports neither quack nor cutlass.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..tuning import QUACK_GEMM_ENV as ENV
from . import OpSet, RouteLog

CAPABILITY = (9, 0)
GLU_MIN_TOKENS = 1024
GLU_ACTIVATIONS = frozenset({"gelu", "gelu_tanh", "silu", "relu"})  # ops.cute.gemm.EPILOGUES
# (N, K) of the weight -> (min tokens while capturing a CUDA graph, min tokens eager)
LINEAR_MIN_TOKENS: dict[tuple[int, int], tuple[int, int]] = {
    (2304, 768): (4096, 16384),    # ModernBERT-base Wqkv
    (768, 768): (4096, 16384),     # base attn.Wo
    (768, 1152): (4096, 16384),    # base mlp.Wo
    (3072, 1024): (7424, 16384),   # large Wqkv
    (1024, 1024): (122880, 122880),  # large attn.Wo: lost at 7,424, won at 122,880; not measured between
}

# The q, k projection with RoPE in its epilogue (ops.cute.gemm.rope_linear) replaces the Wqkv GEMM plus the
# separate (or attention-fused) rotation; v takes the plain linear route. (min tokens in a graph capture, eager)
ROPE_MIN_TOKENS = (4096, 16384)
ROPE_HEAD_DIMS = frozenset({64})  # ops.cute.gemm.ROPE_HEAD_DIMS (kept here so the check imports no quack)

_LOG = RouteLog("cublas: ")
_record = _LOG.record


class _ThreadFlag(threading.local):
    """A per-thread flag set within (nested) ``with flag.on():`` blocks."""

    depth = 0

    @contextlib.contextmanager
    def on(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


_FORCED = _ThreadFlag()       # quack whatever the size (validation), on this thread
_GRAPH_RULES = _ThreadFlag()  # the in-graph size rule (warm-up before a capture), on this thread


def fallbacks() -> dict[str, dict[str, int]]:
    """``{op: {"cublas: <why>": calls}}``: calls that met the size rule but could not take quack."""
    return _LOG.snapshot()


def reset_fallbacks() -> None:
    _LOG.clear()


def forced():
    """Within the block, on this thread, every call quack can take goes to quack whatever its token count (the
    validation's parity check, whose batch is far below the size rules)."""
    return _FORCED.on()


def graph_rules():
    """Within the block, on this thread, calls follow the size rule of CUDA-graph captures even when not
    capturing: the warm-up before a capture must run (and compile) the kernels the capture will bake in."""
    return _GRAPH_RULES.on()


def _kernels():
    from .cute import gemm

    return gemm


def unavailable(device: torch.device, enabled: bool = True) -> str | None:
    """Why the route cannot run on ``device`` (``None`` when it can): the switch is off (``enabled``: the
    ``quack_gemm`` of the tuning read at ``pack()``), not sm_90 CUDA, or the CuteDSL stack (cutlass, quack) does
    not import (checked by importing it: the switch off skips that cost)."""
    device = torch.device(device)
    if not enabled:
        return f"{ENV} is off"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"quack GEMMs run on CUDA (device is {device.type})"
    cap = torch.cuda.get_device_capability(device)
    if cap != CAPABILITY:
        return f"quack GEMMs are routed on sm_90 only, where they were measured (this GPU is sm_{cap[0]}{cap[1]})"
    try:
        _kernels()
    except Exception as exc:  # ImportError, or a DSL that fails to initialise
        return f"quack GEMM epilogues not importable ({exc.__class__.__name__}: {exc})"
    return None


def _on_one_cuda_device(x: Tensor, weight: Tensor) -> bool:
    return x.device == weight.device and x.device.type == "cuda"


def _refusal(x: Tensor, weight: Tensor, bias: Tensor | None) -> str | None:
    """Why quack cannot take this call (recorded), or ``None``."""
    if bias is not None:
        return "bias (the epilogues here take none)"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {x.dtype}"
    if weight.dtype != x.dtype:
        return f"mixed dtypes (x {x.dtype}, weight {weight.dtype})"
    if not _on_one_cuda_device(x, weight):
        return "tensors not on one CUDA device"
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        return f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    # TMA: unit inner stride, 16-byte aligned rows and base addresses
    if x.stride(1) != 1 or x.stride(0) % 8 or weight.stride(1) != 1 or weight.stride(0) % 8:
        return "strides not 16-byte aligned"
    if x.data_ptr() % 16 or weight.data_ptr() % 16 or weight.shape[0] % 8:
        return "addresses or rows not 16-byte aligned"
    return None


def _modes_ok(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """The modes quack does not serve (not recorded: choices, not limits): gradients."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    return True


def for_graph(on_cuda: bool) -> bool:
    """Whether a call on this thread belongs to a CUDA graph (``on_cuda``: its tensors are CUDA tensors): captured
    now, or the warm-up before a capture (:func:`graph_rules`), which must run (and compile) the kernels the
    capture will bake in."""
    return on_cuda and (_GRAPH_RULES.depth > 0 or torch.cuda.is_current_stream_capturing())


def _forced() -> bool:
    return _FORCED.depth > 0


def _linear_min_tokens(x: Tensor, weight: Tensor) -> int | None:
    rule = LINEAR_MIN_TOKENS.get((int(weight.shape[0]), int(weight.shape[1])))
    if rule is None:
        return None
    return rule[0] if for_graph(x.is_cuda) else rule[1]


# The op set's entries are module-level classes, not closures, so that a packed model (whose state holds the
# op set) still pickles and deep-copies.

class _Linear:
    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        # under torch.compile nothing below is traced: size rules would add guards (recompiles at every threshold)
        if torch.compiler.is_compiling() or x.dim() != 2:
            return F.linear(x, weight, bias)
        min_tokens = _linear_min_tokens(x, weight)
        if min_tokens is not None:
            by_size = x.shape[0] >= min_tokens
            if (by_size or _forced()) and _modes_ok(x, weight, bias):
                why = _refusal(x, weight, bias)
                if why is None:
                    return _kernels().linear(x, weight)
                if by_size:
                    _record("linear", why)
        return F.linear(x, weight, bias)


class _RopeLinear:
    """``OpSet.rope_linear``: quack's GEMM with RoPE in the epilogue for q, k (pair order), the ``linear`` route for
    v; ``None`` (not taken) below the size rule, in gradient mode, under ``torch.compile`` or when quack cannot."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor, freq: Tensor,
                 num_heads: int, head_dim: int):
        if torch.compiler.is_compiling() or x.dim() != 2:
            return None
        by_size = x.shape[0] >= (ROPE_MIN_TOKENS[0] if for_graph(x.is_cuda) else ROPE_MIN_TOKENS[1])
        if not ((by_size or _forced()) and _modes_ok(x, weight, bias)):
            return None
        n = num_heads * head_dim
        why = _refusal(x, weight, bias)
        if why is None and head_dim not in ROPE_HEAD_DIMS:
            why = f"head_dim {head_dim} (RoPE epilogue measured at {sorted(ROPE_HEAD_DIMS)})"
        if why is None and weight.shape[0] != 3 * n:
            why = f"Wqkv rows {weight.shape[0]} != 3 * {n}"
        if why is None and (positions.device != x.device or freq.device != x.device):
            why = "RoPE inputs on another device"
        if why is not None:
            if by_size:
                _record("rope_linear", why)
            return None
        t = x.shape[0]
        qk = _kernels().rope_linear(x, weight[:2 * n], positions, freq, head_dim)
        v = _Linear()(x, weight[2 * n:])
        q, k = qk.view(t, 2, num_heads, head_dim).unbind(1)
        return q, k, v.view(t, num_heads, head_dim)


class _GluLinear:
    """quack's GLU epilogue from :data:`GLU_MIN_TOKENS`; below it the base op set's ``glu_linear`` (the Triton
    small-batch GEMM, unless built with ``small=False``: ``PACKED_ENCODERS_FUSED_GLU_GEMM=0`` at ``pack()``)."""

    def __init__(self, base: OpSet, small: bool = True):
        self.base = base
        self.small = small

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
        if not torch.compiler.is_compiling() and x.dim() == 2:
            by_size = x.shape[0] >= GLU_MIN_TOKENS
            if (by_size or _forced()) and _modes_ok(x, weight, bias):
                why = _refusal(x, weight, bias)
                if why is None and activation not in GLU_ACTIVATIONS:
                    why = f"activation {activation!r}"
                if why is None and weight.shape[0] % 32:
                    why = f"{weight.shape[0]} Wi rows (the gated epilogue pairs 16-column halves)"
                if why is None:
                    return _kernels().glu_linear(x, weight, activation)
                if by_size:
                    _record("glu_linear", why)
        if self.small and self.base.glu_linear is not None:
            return self.base.glu_linear(x, weight, bias, activation)
        return self.base.glu(F.linear(x, weight, bias), activation)


class _Fallbacks:
    def __init__(self, base: OpSet):
        self.base = base

    def __call__(self) -> dict:
        base = getattr(self.base, "fallbacks", None)
        out = {op: dict(r) for op, r in (base() if base else {}).items()}
        for op, reasons in fallbacks().items():
            out.setdefault(op, {}).update(reasons)
        return out


class _Smoke:
    def __init__(self, base: OpSet):
        self.base = base

    def __call__(self, device) -> None:
        base = getattr(self.base, "smoke", None)
        if base is not None:
            base(device)
        smoke_quack(device)


def with_quack_gemms(base: OpSet, *, rope: bool = True, small_glu: bool = True) -> OpSet:
    """``base`` with ``linear``, ``glu_linear`` and ``rope_linear`` routed to quack by the rules above (the rest is
    ``base``'s). ``rope``: the RoPE epilogue on the q, k projection (``PACKED_ENCODERS_QUACK_ROPE``; off: no
    ``rope_linear``); ``small_glu``: below quack's GLU size rule, ``base``'s small-batch GLU GEMM
    (``PACKED_ENCODERS_FUSED_GLU_GEMM``); both as read at ``pack()``."""
    extra = {}
    if hasattr(base, "smoke"):  # a FusedOpSet
        extra = dict(smoke=_Smoke(base), fallbacks=_Fallbacks(base))
    return replace(base, linear=_Linear(), glu_linear=_GluLinear(base, small_glu),
                   rope_linear=_RopeLinear() if rope else None, gemm="quack", **extra)


def smoke_quack(device) -> None:
    """Compile (or load from quack's disk cache) and run the GLU-epilogue GEMM, the plain GEMM and the
    RoPE-epilogue GEMM on a small bf16 problem and check them against fp32 references; raises on any failure."""
    from .geglu import geglu_ref
    from .rope import pair_freq_table, rope_linear_ref

    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(200, 64, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(256, 64, generator=g) * 0.125).to(device, torch.bfloat16)
    k = _kernels()
    ref = geglu_ref(F.linear(x.float(), w.float()), "gelu")
    err = ((k.glu_linear(x, w, "gelu").float() - ref).abs().max() / ref.abs().max()).item()
    if not err < 2e-2:
        raise RuntimeError(f"quack GLU GEMM smoke test on {device}: relative error {err:.3g} against fp32")
    ref = F.linear(x.float(), w.float())
    err = ((k.linear(x, w).float() - ref).abs().max() / ref.abs().max()).item()
    if not err < 2e-2:
        raise RuntimeError(f"quack GEMM smoke test on {device}: relative error {err:.3g} against fp32")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    positions = torch.arange(200, dtype=torch.float32) % 77
    ref = rope_linear_ref(x.float().cpu(), w.float().cpu(), positions, inv_freq, 64).to(device)
    freq = pair_freq_table(inv_freq.to(device), 4)
    out = k.rope_linear(x, w, positions.to(device), freq, 64)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    if not err < 2e-2:
        raise RuntimeError(f"quack RoPE-epilogue GEMM smoke test on {device}: relative error {err:.3g} against fp32")
