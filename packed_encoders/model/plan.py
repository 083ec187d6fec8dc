"""The packed forward's op choices as data: decided once per class of calls, then run without re-deciding.

An eager ModernBERT-base forward launches ~110 kernels. When every launch re-checks its inputs (device, dtype,
shape, autocast, size rules) and goes through the ``torch.library`` dispatcher, the host spends several times the
GPU's time on a batch of short documents. A :class:`Plan` makes those choices once for a *call class* (op set,
:class:`Rules`, activation dtype, device, grad mode, token-count class, attention decisions) and is cached; the
forward then calls the chosen implementations directly:

- ``ops``: the op set's unchecked launches (``FusedOpSet.direct``) when its ``covers`` check passes for the
  whole call and no gradient is wanted, else the checked ops (which route per call and record fallbacks).
- per layer (:class:`LayerPlan`): the attention window and backend, and where RoPE happens: in the ``Wqkv``
  GEMM's epilogue (``rope_linear``: the op set's route is asked; it may decline a call), else inside the attention
  kernel (``rope_in_attention``), else as its own op.
- the ``Wi`` + GLU path (``"small_gemm"``: one Triton launch for short calls and eager ones of at most
  :attr:`Rules.glu_eager_max_tokens` tokens; ``"route"``: the op set's
  ``glu_linear`` route, e.g. quack's epilogue; ``"split"``: ``F.linear`` then the GLU op) and the projections
  (``F.linear``; the op set's ``linear`` route where it may take the call; the unchecked Triton GEMM, ``Wi`` + GLU
  included, for eager calls of at most :attr:`Rules.small_linear_max_tokens` tokens, which are host-bound: its
  launch costs less host time than ``F.linear``'s dispatch, and it takes raw pointers (``pointers`` below), while
  a CUDA graph and its warm-up keep cuBLAS, up to ~20 % faster on the GPU at large sizes).
- ``kernels``: with gradients, one ``autograd.Function`` per layer block (:mod:`.blocks`) instead of one per op;
  ``stack``: one for every layer of the encoder (:mod:`.stack`), where the call allows it.
- ``pointers``: every op is one :mod:`.pointers` can launch (Triton kernels on raw pointers, cuBLAS and
  FlashAttention-2 / -4 on views), so the forward may run a call of at most :attr:`Rules.pointer_max_tokens` tokens over
  one workspace (no per-op allocation, shape reads or launch keys).
- ``calls``: the Linear slots whose module the forward calls (:mod:`.calls`: a peft LoRA layer, a wrapped or
  quantised Linear). Every route that reads a projection's weight is off for such a slot (``LayerPlan.calls``: no
  ``rope_linear`` on a called ``Wqkv``; the forward runs a called ``Wi``'s output through the GLU op), and for the
  whole call the routes that read every layer's weights or trust each op's inputs: unchecked launches, raw pointers,
  the training blocks and stack (with gradients, one autograd node per op, through which gradients reach the
  module's own parameters).

Route choices count host time: quack's CuteDSL GEMMs cost ~10-20 us more host time per launch than cuBLAS, so an
eager call consults quack's routes only from :data:`QUACK_EAGER_MIN_TOKENS` tokens (where the forward is
GPU-bound), or while a CUDA graph is captured or validation forces them. Weights are never part of a plan: the
forward reads them from the live modules on every call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from ..attention.backends import BACKENDS, FUSED_ROPE_MAX_TOKENS
from ..ops import TORCH_KERNELS, Kernels, OpSet, quack_gemm
from ..ops.triton import GLU_LINEAR_MAX_TOKENS
from .calls import PLAIN, ModuleCalls
from .params import ModernBertParams
from .pointers import plan_runs_pointers

# Below this many tokens an eager call never consults quack's routes (each would cost host time the GPU does not
# win back: the call is host-bound). The smallest eager size rule of ops.quack_gemm.
QUACK_EAGER_MIN_TOKENS = 16384


@dataclass(frozen=True)
class Rules:
    """The switches and thresholds a plan reads: a packed model's are :func:`rules_for` its frozen tuning (read at
    ``pack()``); the defaults (:func:`default_rules`) are a default ``Tuning()``'s.

    Attributes:
        lean: unchecked launches and per-block autograd where they apply; ``False``: the per-op checked path.
        fused_rope: hand RoPE to attention backends that fuse it (inference).
        fused_rope_max_tokens: local layers of calls with at least this many tokens rotate in a separate pass.
        glu_gemm_max_tokens: the Triton ``Wi`` + GLU GEMM serves calls of at most this many tokens (0: never).
        small_linear_max_tokens: eager no-grad calls of at most this many tokens run every projection (``Wi`` +
            GLU included) as Triton GEMMs (0: never). H200, ModernBERT-base, bf16, GPU time of a layer's four
            GEMMs, Triton / cuBLAS (``Wi`` + the GLU kernel there): 0.82x at 256 tokens, 0.80x at 1,024, 1.01x at
            3,300, 1.14x at 7,400, 1.20x at 16,384 (``gemm_eager`` rows in benchmarks/results/h200); an eager call of
            a few thousand tokens spends more host time than GPU time on cuBLAS's dispatch alone.
        glu_eager_max_tokens: eager no-grad calls of at most this many tokens run ``Wi`` + GLU as one Triton GEMM
            (past ``small_linear_max_tokens``, the other projections on cuBLAS): H200, 8,192 tokens, 60.6 us
            against 62.6 for cuBLAS + the GLU kernel (``small_gemm.TUNED``), and one launch and one cuBLAS call
            fewer per layer on the host; at 16,384 tokens cuBLAS + GLU is ~10 % faster.
        quack_eager_min_tokens: eager calls below this many tokens never consult quack's routes.
        pointer_max_tokens: eager no-grad calls of at most this many tokens may run as raw-pointer launches over one
            workspace (:mod:`.pointers`; host-bound sizes: larger calls are GPU-bound, and the workspace holds every
            buffer of a layer at once, ~1.5x the tensor path's peak).
        blocks: training forwards as per-block autograd functions: ``None`` where the op family's kernels are
            fused (Triton; plain-torch ops keep autograd's own C++ backwards, cheaper than Python twins), ``True``
            for any family with kernels (tests use it to check the block maths on CPU), ``False`` never.
        stack: where the blocks run and the call allows it (:func:`.stack.stack_problem`), every layer as one
            autograd node (:mod:`.stack`); ``False``: one node per block.
    """

    lean: bool = True
    fused_rope: bool = True
    fused_rope_max_tokens: int = FUSED_ROPE_MAX_TOKENS
    glu_gemm_max_tokens: int = GLU_LINEAR_MAX_TOKENS
    small_linear_max_tokens: int = 4096
    glu_eager_max_tokens: int = 8192
    quack_eager_min_tokens: int = QUACK_EAGER_MIN_TOKENS
    pointer_max_tokens: int = QUACK_EAGER_MIN_TOKENS
    blocks: bool | None = None
    stack: bool = True


_DEFAULT_RULES = Rules()
_TUNED_RULES: dict = {}


def rules_for(tuning) -> Rules:
    """The :class:`Rules` of an encoder's frozen ``packed_encoders.tuning.Tuning`` (its ``lean``, ``fused_rope``
    and ``fused_glu_gemm`` switches as read at ``pack()``), memoised per tuning object."""
    hit = _TUNED_RULES.get(id(tuning))
    if hit is not None and hit[0] is tuning:
        return hit[1]
    small = bool(tuning.fused_glu_gemm)
    rules = Rules(lean=bool(tuning.lean), fused_rope=bool(tuning.fused_rope),
                  glu_gemm_max_tokens=_DEFAULT_RULES.glu_gemm_max_tokens if small else 0,
                  small_linear_max_tokens=_DEFAULT_RULES.small_linear_max_tokens if small else 0,
                  glu_eager_max_tokens=_DEFAULT_RULES.glu_eager_max_tokens if small else 0)
    if len(_TUNED_RULES) > 64:
        _TUNED_RULES.clear()
    _TUNED_RULES[id(tuning)] = (tuning, rules)
    return rules


def default_rules() -> Rules:
    """The rules of a default ``Tuning()`` (every switch on), for direct callers of the packed forward; a packed
    model's routes pass :func:`rules_for` of the tuning read at its ``pack()``."""
    return _DEFAULT_RULES


@dataclass(frozen=True)
class LayerPlan:
    window: int | None  # half window; None: global (or a band covering every sequence)
    backend: str
    attention: Callable
    rope_linear: bool  # ask the op set's rope_linear route first
    rope_in_attention: bool  # else hand the rotation to the attention kernel (else: its own op)
    calls: tuple[bool, bool, bool, bool] = PLAIN  # (Wqkv, attn.Wo, mlp.Wi, mlp.Wo): the forward calls the module


@dataclass(frozen=True)
class Plan:
    ops: OpSet
    direct: bool
    kernels: Kernels | None  # with gradients: the raw launches of the per-block autograd functions (.blocks)
    glu: str  # "small_gemm" | "route" | "split"
    glu_linear: Callable | None  # what "small_gemm" / "route" call (the route is the op set's own, e.g. quack's)
    linear: Callable
    layers: tuple[LayerPlan, ...]
    why_checked: str | None  # why the checked ops run (None when direct)
    linear_route: str = "F.linear"  # what ``linear`` is, for describe(): "F.linear" | "small_gemm" | the route's gemm
    pointers: bool = False  # short calls may run as raw-pointer launches (.pointers.plan_runs_pointers, no autocast)
    stack: bool = False  # with gradients: every layer's blocks in one autograd node (.stack)
    stack_off: str | None = None  # with gradients and no stack: why (.stack.stack_problem, the rules, the op set)
    calls: ModuleCalls | None = None  # the Linear slots whose module the forward calls (None: all nn.Linear)
    merged: int = 0  # slots holding peft LoRA layers run as one GEMM on their merged weights (.calls.merged_weights)


NOT_ASKED = "not asked for by the caller"  # plan_for's default stack_off: one node per block
_CACHE: dict = {}
_LOCK = threading.Lock()
_CACHE_SIZE = 256
_LAST = threading.local()  # .plan: the last plan this thread's forward ran (the eager route shows it in describe())


def last_plan() -> Plan | None:
    """The :class:`Plan` of the last packed forward run on this thread (``None`` before the first)."""
    return getattr(_LAST, "plan", None)


def _quack_active(ops: OpSet, device: torch.device, tokens: int, rules: Rules) -> bool:
    """Whether quack's routes may take a call of ``tokens`` now (its wrappers then decide per op)."""
    if ops.gemm != "quack" or ops.linear is None:
        return False
    if tokens >= rules.quack_eager_min_tokens:
        return True
    return quack_gemm._forced() or quack_gemm.for_graph(device.type == "cuda")


def plan_for(params: ModernBertParams, ops: OpSet, attention: Mapping, *, tokens: int, max_seqlen: int,
             dtype: torch.dtype, device: torch.device, grad: bool, rules: Rules | None = None,
             stack_off: str | None = NOT_ASKED, calls: ModuleCalls | None = None, merged: int = 0) -> Plan:
    """The :class:`Plan` of one call (cached per call class; see the module docstring).

    ``attention``: ``{window: Decision}`` from :func:`..model.forward.plan_attention` (global: ``None``);
    ``stack_off``: why the call cannot run every layer as one autograd node (:func:`.stack.stack_problem`), or
    ``None`` when it can; kept on the plan for ``describe()``; ``calls``: the encoder's called Linear slots
    (:func:`.calls.read_calls`; ``None``: every slot is an ``nn.Linear``, whose plans are as they were without it);
    ``merged``: how many slots run on merged adapter weights (:func:`.calls.merged_weights`), which the raw-pointer
    runs, reading every slot's module, do not take.
    """
    rules = rules or default_rules()
    compiling = torch.compiler.is_compiling()
    quack = not grad and not compiling and (_quack_active(ops, device, tokens, rules) if rules.lean
                                            else ops.gemm == "quack" and ops.linear is not None)
    glu_small = 0 < tokens <= rules.glu_gemm_max_tokens
    # a CUDA graph replays without host cost: its projections (and its warm-up's) stay on cuBLAS
    graph = quack_gemm.for_graph(device.type == "cuda")
    host_bound = not grad and not compiling and not quack and not graph  # an eager call's host time counts
    small_linear = host_bound and 0 < tokens <= rules.small_linear_max_tokens
    glu_eager = host_bound and 0 < tokens <= rules.glu_eager_max_tokens
    # raw-pointer runs: host-bound eager calls only (a graph's capture or warm-up records the tensor path)
    pointers = host_bound and tokens <= rules.pointer_max_tokens and not merged
    rope_local_fused = tokens < rules.fused_rope_max_tokens or compiling
    decisions = tuple(sorted(((-1 if w is None else w), d.backend) for w, d in attention.items()))
    autocast = device.type == "cuda" and torch.is_autocast_enabled("cuda")
    key = (params, id(ops), rules, dtype, device, grad, compiling, quack, glu_small, glu_eager, small_linear,
           rope_local_fused, decisions, params.window >= max_seqlen - 1, autocast, stack_off, pointers, calls, merged)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is ops:
        _LAST.plan = hit[1]
        return hit[1]
    plan = _LAST.plan = _build(params, ops, attention, tokens=tokens, max_seqlen=max_seqlen, dtype=dtype,
                               device=device, grad=grad, rules=rules, quack=quack, glu_small=glu_small,
                               glu_eager=glu_eager, small_linear=small_linear, compiling=compiling, autocast=autocast,
                               stack_off=stack_off, pointers=pointers, calls=calls)
    if merged:
        plan = _LAST.plan = replace(plan, merged=merged)
    with _LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (ops, plan)
    return plan


def _layer_window(params: ModernBertParams, index: int, max_seqlen: int) -> int | None:
    window = params.layer_window(index)
    if window is not None and window >= max_seqlen - 1:
        return None  # the band covers every sequence: a global layer in effect, and cheaper
    return window


def _build(params, ops, attention, *, tokens, max_seqlen, dtype, device, grad, rules, quack, glu_small, glu_eager,
           small_linear, compiling, autocast, stack_off, pointers, calls) -> Plan:
    direct, why = False, None
    if not rules.lean:
        why = "PACKED_ENCODERS_LEAN is off (the per-op checked path everywhere)"
    elif calls is not None:
        # a called module's output (dtype, layout) is whatever it returns: the checked ops route on what they get
        why = calls.plan_reason()
    elif grad:
        why = "gradients wanted (unchecked launches have no backward)"
    elif compiling:
        why = "traced by torch.compile"
    elif getattr(ops, "direct", None) is None:
        why = f"the {ops.name!r} op set has no unchecked launches"
    else:
        why = ops.covers(device, dtype, params.hidden_size, params.num_attention_heads, params.head_dim,
                         params.activation)
        direct = why is None
    run_ops = ops.direct if direct else ops
    kernels = None
    # the training blocks and stack take every projection's weight as an input: never with a called slot
    if (rules.lean and grad and not compiling and ops.kernels is not None and rules.blocks is not False
            and calls is None):
        covers = getattr(ops, "covers", None)
        why_not = None if covers is None else covers(device, dtype, params.hidden_size, params.num_attention_heads,
                                                     params.head_dim, params.activation)
        kernels = ops.kernels if why_not is None else TORCH_KERNELS
        if kernels is TORCH_KERNELS and rules.blocks is None:
            kernels = None
    # An op set's own routes (linear, rope_linear, glu_linear) serve forwards without gradient; quack's are
    # consulted only where its host cost per launch is paid back (``quack``: see _quack_active)
    routed = not grad and (quack or ops.gemm != "quack")
    # the RoPE that runs here zeroes v's non-finite entries: an attention that would clean v skips its own pass
    finite_v = kernels.rope_finite_v if grad and kernels is not None else (not grad and run_ops.rope_finite_v)
    layers = []
    for index in range(params.num_hidden_layers):
        window = _layer_window(params, index, max_seqlen)
        name = attention[window].backend
        backend = BACKENDS[name]
        # the size rule was measured on local layers (key tiles rotated again by ~3 query tiles); global layers
        # keep the fused rotation at any size
        in_attention = backend.fuse_rope(grad, None if window is None else tokens, enabled=rules.fused_rope,
                                         max_tokens=rules.fused_rope_max_tokens)
        unchecked = direct or (kernels is not None and backend.direct_grad)
        fn = backend.direct if unchecked and backend.direct is not None else backend.fn
        called = PLAIN if calls is None else calls.layers[index]
        rope_linear = routed and ops.rope_linear is not None and not called[0]  # (the epilogue reads Wqkv's weight)
        if finite_v and backend.finite_v is not None and not (rope_linear or in_attention):
            fn = backend.finite_v  # (a rope_linear epilogue or the attention itself would rotate: v not cleaned)
        layers.append(LayerPlan(window, name, fn, rope_linear, in_attention, called))
    if grad:
        glu = "split"
    elif routed and ops.gemm == "quack" and ops.glu_linear is not None:
        glu = "route"
    elif direct and (glu_small or glu_eager or small_linear) and run_ops.glu_linear is not None:
        glu = "small_gemm"
    elif not direct and ops.glu_linear is not None and (glu_small or (not rules.lean and rules.glu_gemm_max_tokens)):
        glu = "route"  # the checked op applies its own size and cover rules (0 tokens: the switch is off)
    else:
        glu = "split"
    glu_linear = {"small_gemm": run_ops.glu_linear, "route": ops.glu_linear}.get(glu)
    if direct and small_linear and run_ops.linear is not None:
        linear, linear_route = run_ops.linear, "small_gemm"
    elif routed and ops.linear is not None:
        linear, linear_route = ops.linear, ops.gemm
    else:
        linear, linear_route = F.linear, "F.linear"
    plan = Plan(run_ops, direct, kernels, glu, glu_linear, linear, tuple(layers), why, linear_route, calls=calls)
    stacked = stack_off is None and kernels is not None and rules.stack
    if stacked or not grad:
        stack_off = None
    elif kernels is None:
        # the call's own reason too (gradient checkpointing, hidden states...): it holds on this path as well
        also = "" if stack_off in (None, NOT_ASKED) else f"; and {stack_off}"
        stack_off = "one autograd node per op: " + (
            "PACKED_ENCODERS_LEAN is off" if not rules.lean else "traced by torch.compile" if compiling
            else calls.summary() if calls is not None
            else "Rules.blocks is off" if rules.blocks is False
            else f"the {ops.name!r} op set runs plain PyTorch ops here (autograd's own backwards)") + also
    elif not rules.stack:
        stack_off = "Rules.stack is off (a training CUDA graph's capture records per-block nodes)"
    # under CUDA autocast the norms' outputs are fp32 and the projections cast them: not the one-dtype workspace
    pointers = pointers and not autocast and calls is None and plan_runs_pointers(plan)
    return replace(plan, pointers=pointers, stack=stacked, stack_off=stack_off)


__all__ = ["LayerPlan", "Plan", "QUACK_EAGER_MIN_TOKENS", "Rules", "default_rules", "last_plan", "plan_for",
           "rules_for"]
