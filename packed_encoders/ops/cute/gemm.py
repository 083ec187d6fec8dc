"""quack CuteDSL GEMMs (sm90+): ModernBERT's ``Wi`` projection with its GLU in the epilogue, and plain ones.

``y = act(x @ W[:I].T) * (x @ W[I:].T)`` ``[M, I]`` from HF's own ``Wi`` weight ``[2I, K]``: the ``[M, 2I]``
intermediate is never written and the separate GLU launch is gone. quack's GEMM reads the weight in place:
``concat_layout=("B",)`` views the concatenated ``[a; g]`` rows as interleaved pairs, so each accumulator
pair holds ``(a_j, g_j)`` and the epilogue writes ``act(a_j) * g_j`` once, rounded from fp32.

quack ships gated epilogues for SwiGLU / ReGLU and a GeGLU with the *tanh* approximation; ModernBERT's
``hidden_activation="gelu"`` is the exact erf GELU (HF ``GELUActivation``), so the epilogues here are our
own, written with quack's ``@gemm_epilogue`` (activations from ``quack.activation``: ``gelu_erf``,
``gelu_tanh_approx``, ``silu``, ``relu``).

``rope_linear``: ModernBERT's ``q, k`` projection with RoPE in the epilogue, so the rotation costs no pass of its
own. quack's rotary epilogues rotate *adjacent* accumulator columns ``(2j, 2j + 1)``; ModernBERT (NeoX layout)
rotates column ``d`` with ``d + head_dim / 2`` in each head. The GEMM therefore reads HF's ``Wqkv`` rows in place
through a per-head pair layout (``(2, head_dim / 2, heads)``, the counterpart of ``concat_layout``'s
``(2, N / 2)``), which puts rows ``d`` and ``d + head_dim / 2`` of each head in adjacent GEMM columns, and stores
D in GEMM order: each head's dims come out as ``(0, 32, 1, 33, ...)``. q and k get the same order, so
``q . k`` (and so attention) is unchanged; v never goes through this GEMM.

Nothing here is imported until used (importing quack loads the CuteDSL compiler). Each (shape class,
config) compiles once per process, several seconds; compiled kernels are cached on disk by quack.
"""

from __future__ import annotations

import contextlib
import threading

import cutlass.cute as cute
import quack
import quack.activation as _qa
import quack.layout_utils as _layout_utils
import torch
from quack.epilogue import gemm_epilogue, pack, unpack
from quack.epilogue import rotary as _rotary
from quack.epilogue.ops import ColVecLoad, RowVecLoad
from quack.gemm_config import GemmConfig


class _Activation:
    """A ``quack.activation`` function under a stable compile-cache key.

    quack keys each epilogue's kernels by fingerprinting the Python functions it references, recursing into
    them unless they live in an installed package directory. Installed elsewhere (``pip install --target``,
    a source checkout), that recursion reaches CuteDSL internals that cannot be fingerprinted and the
    decoration raises; naming the activation and quack's version instead keys the same math."""

    def __init__(self, name: str):
        self.name = name
        self.fn = getattr(_qa, name)

    def __call__(self, x):
        return self.fn(x)

    def __quack_semantic_key__(self):
        return ("packed_encoders.glu_gemm", self.name, getattr(quack, "__version__", "?"))


_GELU_ERF = _Activation("gelu_erf")
_GELU_TANH = _Activation("gelu_tanh_approx")
_SILU = _Activation("silu")
_RELU = _Activation("relu")


@gemm_epilogue(outputs=("postact",), mode="acc_pair")
def _geglu_erf(acc):
    a, g = unpack(acc)
    return {"postact": _GELU_ERF(a) * g}


@gemm_epilogue(outputs=("postact",), mode="acc_pair")
def _geglu_tanh(acc):
    a, g = unpack(acc)
    return {"postact": _GELU_TANH(a) * g}


@gemm_epilogue(outputs=("postact",), mode="acc_pair")
def _swiglu(acc):
    a, g = unpack(acc)
    return {"postact": _SILU(a) * g}


@gemm_epilogue(outputs=("postact",), mode="acc_pair")
def _reglu(acc):
    a, g = unpack(acc)
    return {"postact": _RELU(a) * g}


# keys: the activation names of ops.triton.glu.ACTIVATIONS
EPILOGUES = {"gelu": _geglu_erf, "gelu_tanh": _geglu_tanh, "silu": _swiglu, "relu": _reglu}


# Per-size configs for the GLU GEMM (H200, ModernBERT-base Wi 2304 x 768, CUDA-graph GPU time,
# benchmarks/gemm_epilogue.py): at 7,424 tokens 128 x 128 with a cluster of 2 along M took 36.5 us against 38.4
# for quack's sm90 default (128 x 192, cluster 2 x 1); at 122,880 tokens 128 x 192 with a cluster of 2 along N took
# 563.4 us against 622.5. Sizes between were not measured: the switch sits near their geometric mean.
GLU_LARGE_TOKENS = 32768
GLU_CONFIG_SMALL = GemmConfig(tile_m=128, tile_n=128, cluster_m=2, cluster_n=1, pingpong=True,
                              is_dynamic_persistent=False)
GLU_CONFIG_LARGE = GemmConfig(tile_m=128, tile_n=192, cluster_m=1, cluster_n=2, pingpong=True,
                              is_dynamic_persistent=False)


def glu_config(m: int) -> GemmConfig:
    """The measured config for a GLU GEMM of ``m`` rows (:data:`GLU_LARGE_TOKENS`)."""
    return GLU_CONFIG_LARGE if m >= GLU_LARGE_TOKENS else GLU_CONFIG_SMALL


def glu_linear(x: torch.Tensor, weight: torch.Tensor, activation: str, config=None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ weight[:I].T) * (x @ weight[I:].T)`` ``[M, I]`` in ``x.dtype``.

    Args:
        x: ``[M, K]`` bf16/fp16 CUDA, K-contiguous.
        weight: ``[2I, K]`` (HF ``Wi.weight``, read in place), same dtype and device.
        activation: a key of :data:`EPILOGUES`.
        config: a ``quack.gemm_config.GemmConfig`` (``None``: :func:`glu_config` of ``M``; no autotuning).
        out: optional ``[M, I]`` output buffer.

    Raises:
        ValueError: unknown activation, or shapes / dtypes quack's GEMM does not take.
    """
    if activation not in EPILOGUES:
        raise ValueError(f"activation must be one of {sorted(EPILOGUES)}, got {activation!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] % 2:
        raise ValueError(f"x [M, K] and weight [2I, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"bf16/fp16 x and weight of one dtype expected, got {x.dtype} and {weight.dtype}")
    m, i = x.shape[0], weight.shape[0] // 2
    if out is None:
        out = torch.empty((m, i), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = glu_config(m) if config is None else config
    EPILOGUES[activation](x, weight.t(), None, out={"postact": out}, store_d=False, config=config,
                          tuned=False, concat_layout=("B",))
    return out


@gemm_epilogue(mode="element")
def _plain(acc):
    return {"D": acc}


def linear(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ weight.T`` ``[M, N]`` in ``x.dtype`` with quack's GEMM.

    ``x`` ``[M, K]`` and ``weight`` ``[N, K]`` (HF ``nn.Linear.weight``, read in place), bf16/fp16 CUDA.
    ``config``: ``None`` runs ``quack.gemm_interface.gemm`` with quack's default config for the GPU; a
    ``GemmConfig`` runs the same GEMM (identity epilogue) under that config."""
    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[0]))
    if config is None:
        from quack.gemm_interface import gemm

        return gemm(x, weight.t(), tuned=False)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _plain(x, weight.t(), None, out={"D": out}, config=config, tuned=False)
    return out


# ---- RoPE in the q, k projection's epilogue -------------------------------------------------------------------

ROPE_HEAD_DIMS = frozenset({64})  # measured (ModernBERT base / large, Ettin, mmBERT); others are not routed here
# H200, ModernBERT-base q, k (N = 1536, K = 768) + v, CUDA-graph GPU time (benchmarks/gemm_epilogue.py --ops rope):
# 128 x 192 pingpong without a cluster was the fastest of seven configs at 4,096 / 7,424 / 16,384 tokens
# (25.6 / 43.0 / 90.4 us with v); at 122,880 tokens a cluster of 2 along N was (664.4 against 674.6 us). A
# cluster along M multicasts B in halves of tile_n, which must stay whole heads of the pair layout (quack's sm90
# default, 128 x 192 with cluster 2 x 1, would split one).
ROPE_LARGE_TOKENS = 65536
ROPE_CONFIG = GemmConfig(tile_m=128, tile_n=192, cluster_m=1, cluster_n=1, pingpong=True,
                         is_dynamic_persistent=False)
ROPE_CONFIG_LARGE = GemmConfig(tile_m=128, tile_n=192, cluster_m=1, cluster_n=2, pingpong=True,
                               is_dynamic_persistent=False)


class _HeadPairs(threading.local):
    """While set (on this thread), quack's ``concat_layout`` transform lays a mode out as per-head pairs."""

    head_dim = 0

    @contextlib.contextmanager
    def on(self, head_dim: int):
        prev, self.head_dim = self.head_dim, head_dim
        try:
            yield
        finally:
            self.head_dim = prev


_HEAD_PAIRS = _HeadPairs()


def head_pair_layout(a, dim: int, head_dim: int):
    """View mode ``dim`` of ``a`` (``heads * head_dim`` rows of stride ``s``) as ``(2, head_dim // 2, heads)`` with
    strides ``(head_dim // 2 * s, s, head_dim * s)``: GEMM column ``2 d + p`` of head ``h`` is row
    ``h * head_dim + p * head_dim // 2 + d``."""
    half = head_dim // 2
    heads = cute.size(a, mode=[dim]) // head_dim
    s = a.stride[dim]
    shape = (*a.shape[:dim], (2, half, heads), *a.shape[dim + 1:])
    stride = (*a.stride[:dim], (half * s, s, head_dim * s), *a.stride[dim + 1:])
    return cute.make_tensor(a.iterator, cute.make_layout(shape, stride=stride))


def _wrap_concat_to_interleave() -> None:
    """Wrap ``quack.layout_utils.concat_to_interleave`` (called at trace time for each operand named in
    ``concat_layout``) so that, inside ``_HEAD_PAIRS.on(head_dim)``, it builds :func:`head_pair_layout`. Outside
    the block it is quack's function unchanged (the GLU GEMMs' ``(2, N / 2)``). Done once, when this module is
    imported (a re-import finds the wrapper in place)."""
    original = _layout_utils.concat_to_interleave
    if getattr(original, "_packed_encoders_head_pairs", False):
        return

    def concat_to_interleave(a, dim):
        head_dim = _HEAD_PAIRS.head_dim
        if head_dim:
            return head_pair_layout(a, dim, head_dim)
        return original(a, dim)

    concat_to_interleave._packed_encoders_head_pairs = True
    _layout_utils.concat_to_interleave = concat_to_interleave


_wrap_concat_to_interleave()


class _PairRotation:
    """quack's float-float angle and sincos (``rope_posfreq_epi``'s math) under a key that also names the pair
    layout: kernels compiled with the layout must never be confused with plain ``concat_layout`` ones."""

    def __call__(self, x1, x2, pos, freq):
        s, c = _rotary._sincos_turns(*_rotary._angle_turns(pos, freq))
        return x1 * c - x2 * s, x1 * s + x2 * c

    def __quack_semantic_key__(self):
        # names the layout and every head_dim it is traced with (ROPE_HEAD_DIMS): extend both together
        return ("packed_encoders.rope_linear", "head-pairs", tuple(sorted(ROPE_HEAD_DIMS)),
                getattr(quack, "__version__", "?"))


_ROTATE = _PairRotation()


@gemm_epilogue(ops={"pos": ColVecLoad("pos"), "freq": RowVecLoad("freq")}, mode="acc_pair")
def _neox_pair_rope(acc, pos, freq):
    x1, x2 = unpack(acc)
    y1, y2 = _ROTATE(x1, x2, pos, freq)
    return {"D": pack(y1, y2)}


def rope_linear(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor,
                head_dim: int, config: GemmConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``rope(x @ weight.T)`` ``[M, N]`` in ``x.dtype``, each head's dims in pair order ``(0, hd/2, 1, hd/2+1, ...)``.

    Args:
        x: ``[M, K]`` bf16/fp16 CUDA, K-contiguous.
        weight: ``[N, K]``, ``N = heads * head_dim`` (HF ``Wqkv.weight[:2 * hidden]``: q and k rows, read in place).
        positions: ``[M]`` fp32, each token's position in its sequence (exact up to 2**24).
        freq: ``[N]`` fp32 per-column rates (``packed_encoders.ops.rope.pair_freq_table``).
        head_dim: one of :data:`ROPE_HEAD_DIMS`.
        config: a ``GemmConfig`` (default :data:`ROPE_CONFIG`, :data:`ROPE_CONFIG_LARGE` from
            :data:`ROPE_LARGE_TOKENS` rows); its ``tile_n / cluster_m`` must be whole heads.
        out: optional ``[M, N]`` output buffer.

    Rotation: ``(x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)`` at ``angle = position * inv_freq`` on the fp32
    accumulator, rounded once (HF rounds q, k before rotating); the angle is computed exactly (quack's float-float
    turns), where HF rounds ``position * inv_freq`` to fp32.

    Raises:
        ValueError: shapes, dtypes or a ``head_dim`` this GEMM does not take.
    """
    if head_dim not in ROPE_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {sorted(ROPE_HEAD_DIMS)}, got {head_dim}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] % head_dim:
        raise ValueError(f"x [M, K] and weight [heads * {head_dim}, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"bf16/fp16 x and weight of one dtype expected, got {x.dtype} and {weight.dtype}")
    m, n = x.shape[0], weight.shape[0]
    if positions.shape != (m,) or positions.dtype != torch.float32:
        raise ValueError(f"positions must be fp32 [{m}], got {positions.dtype} {tuple(positions.shape)}")
    if freq.shape != (n,) or freq.dtype != torch.float32:
        raise ValueError(f"freq must be fp32 [{n}] (ops.rope.pair_freq_table), got {freq.dtype} {tuple(freq.shape)}")
    if config is None:
        config = ROPE_CONFIG_LARGE if m >= ROPE_LARGE_TOKENS else ROPE_CONFIG
    if config.tile_n % head_dim or (config.tile_n // config.cluster_m) % head_dim:
        raise ValueError(f"config tile_n {config.tile_n} / cluster_m {config.cluster_m} splits a head")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    with _HEAD_PAIRS.on(head_dim):
        _neox_pair_rope(x, weight.t(), None, out={"D": out}, config=config, tuned=False, concat_layout=("B",),
                        pos=positions, freq=freq)
    return out
