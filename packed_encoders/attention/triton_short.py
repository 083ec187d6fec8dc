"""In-tree Triton attention forward for packed short sequences (backend ``"triton"``, inference only).

Envelope (checked by :func:`envelope`, stated again in ``docs/attention.md``):

- CUDA tensors on sm_80 or newer, triton importable; no gradients, no attention dropout;
- ``q, k, v`` fp16 or bf16, ``[T, heads, head_dim]`` with ``head_dim`` in :data:`HEAD_DIMS`, any head count,
  unit stride on ``head_dim``; other strides are runtime arguments, so ``v`` may be a view of the fused
  ``[T, 3, heads, head_dim]`` projection;
- global layers: ``max_seqlen <= MAX_SEQLEN``; local layers: a half window ``<= MAX_LOCAL_WINDOW`` at any
  ``max_seqlen`` (a query tile's key span is ``BLOCK_M + 2 * window`` whatever the sequence length, so the
  kernel's cost per token does not grow with ``max_seqlen`` there).

With ``rope=(cos, sin, rows)`` the kernel also applies the rotary embedding to unrotated ``q, k`` (views of the
fused projection), saving the separate RoPE launch per layer; the backend entry says so with ``fuses_rope``.

Past ``MAX_SEQLEN`` on global layers the kernel still computes the right answer, but it has neither TMA nor warp
specialisation and FlashAttention is expected to win there (``benchmarks/attention.py --beyond-envelope``
measures it); dispatch never picks it there. ``MAX_SEQLEN`` is to be narrowed to where the H200 sweep shows
the kernel winning.

Nothing here imports triton at import time: the kernel module is loaded on the first call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from ..ops.triton import interpret_enabled
from .backends import Backend, Workload, register

MAX_SEQLEN = 1024
MAX_LOCAL_WINDOW = 512  # half window; ModernBERT's is 64
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
_ROW_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634
_I32_END = 1 << 31
# launch signature -> the runtime's Bound (launches that skip Triton's per-argument key; see
# packed_encoders.ops.triton._runtime.launch_cached)
_BOUND: dict = {}


@dataclass(frozen=True)
class TileConfig:
    """Launch shape. ``grid``: ``"stream"`` (tiles over the packed rows) or ``"seq"`` (tiles per sequence)."""

    block_m: int
    block_n: int
    heads_per_program: int = 1
    num_warps: int = 4
    num_stages: int = 2
    grid: str = "stream"

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value}: tl.dot needs a power of two >= 16")
        if self.grid not in ("stream", "seq"):
            raise ValueError(f"grid={self.grid!r} is not 'stream' or 'seq'")
        if self.heads_per_program < 1:
            raise ValueError("heads_per_program must be >= 1")


_SHORT = TileConfig(32, 64)          # <= 64 rows: a tile spans about two sequences; few key tiles each
_MID = TileConfig(64, 64)            # <= 128
_LONG_GLOBAL = TileConfig(128, 64, num_warps=8)
_LONG_LOCAL = TileConfig(64, 64)     # key span per tile is block_m + 2 * window: keep block_m small

# Keyed by max_seqlen bucket (upper edge) so a model compiles at most len(buckets) x {global, local} variants
# per (dtype, head_dim), however its batch lengths vary. (bucket, global config, local config).
TILE_TABLE: dict[int, tuple[tuple[int, TileConfig, TileConfig], ...]] = {
    64: ((64, _SHORT, _SHORT), (128, _MID, _MID), (MAX_SEQLEN, _LONG_GLOBAL, _LONG_LOCAL)),
    128: ((64, _SHORT, _SHORT), (128, _MID, _MID), (MAX_SEQLEN, _LONG_GLOBAL, _LONG_LOCAL)),
}


def tile_config(max_seqlen: int, head_dim: int, local: bool) -> TileConfig:
    """The table's launch shape for a batch (the last bucket also serves lengths past the envelope)."""
    rows = TILE_TABLE.get(head_dim)
    if rows is None:
        raise ValueError(f"no tile table for head_dim={head_dim} (supported: {HEAD_DIMS})")
    for edge, glob, loc in rows:
        if max_seqlen <= edge:
            break
    return loc if local else glob


# Named alternatives the benchmark times against the table (same kernel, other launch shapes): the grid kind,
# heads per program, pipelining, and fixed tile sizes from 16 to 128 rows.
VARIANTS = {
    "table": lambda s, d, local: tile_config(s, d, local),
    "seq-grid": lambda s, d, local: replace(tile_config(s, d, local), grid="seq"),
    "heads2": lambda s, d, local: replace(tile_config(s, d, local), heads_per_program=2),
    "stages1": lambda s, d, local: replace(tile_config(s, d, local), num_stages=1),
    "m16": lambda s, d, local: TileConfig(16, 32, num_warps=2),
    "m32": lambda s, d, local: TileConfig(32, 64),
    "m64": lambda s, d, local: TileConfig(64, 64),
    "m128": lambda s, d, local: TileConfig(128, 64, num_warps=8),
}
# The benchmark times the variants only where they matter most (and compile time stays bounded).
VARIANT_MAX_SEQLEN = 128


@functools.lru_cache(maxsize=None)
def _kernel(rope: bool = False):
    """The entry point: ``packed_attn_rope_fwd`` (unrotated q, k) with ``rope``, else ``packed_attn_fwd``."""
    from . import triton_short_kernel

    return triton_short_kernel.packed_attn_rope_fwd if rope else triton_short_kernel.packed_attn_fwd


@functools.lru_cache(maxsize=None)
def _fast_kernel(rope: bool = False):
    """The kernel behind :class:`~packed_encoders.ops.triton._runtime.FastLauncher` (CUDA launches)."""
    from triton.runtime.jit import JITFunction

    from ..ops.triton._runtime import FastLauncher

    fn = _kernel(rope)
    return FastLauncher(fn) if isinstance(fn, JITFunction) else fn


@functools.lru_cache(maxsize=None)
def _runtime():
    """``packed_encoders.ops.triton._runtime``, imported on first launch (importing this module loads no Triton)."""
    from ..ops.triton import _runtime

    return _runtime


@functools.lru_cache(maxsize=None)
def _interpreted_kernel(rope: bool = False):
    """The kernel for CPU tensors (``TRITON_INTERPRET=1``), each launch run inside the runtime's interpreter fixes:
    Triton's standard library in its interpreted form, GPU rounding of fp32 -> bf16 casts, and every patch of
    ``triton.language`` undone afterwards (left in place they break later compilation in the process)."""
    from ..ops.triton._runtime import _Interpreted

    return _Interpreted(_kernel(rope))


@functools.lru_cache(maxsize=None)
def triton_status() -> str | None:
    """``None`` when the kernel can run on this machine's GPU, else why not."""
    if not torch.cuda.is_available():
        return "the Triton attention kernel needs CUDA"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"the Triton attention kernel needs sm_80 or newer (this GPU is sm_{major}{minor})"
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton does not import ({exc.__class__.__name__}: {exc})"
    return None


def envelope(w: Workload) -> str | None:
    """``None`` when ``w`` is inside the kernel's envelope, else the reason it is not."""
    if w.device_type != "cuda":
        return f"the Triton attention kernel needs CUDA tensors (got {w.device_type})"
    if w.dtype not in DTYPES:
        return f"the Triton attention kernel runs fp16/bf16 (got {w.dtype})"
    if w.head_dim not in HEAD_DIMS:
        return f"the Triton attention kernel supports head_dim {HEAD_DIMS} (got {w.head_dim})"
    local = w.window is not None and w.window < w.max_seqlen - 1
    if local and w.window > MAX_LOCAL_WINDOW:
        return f"half window {w.window} > {MAX_LOCAL_WINDOW}, the Triton kernel's envelope for local layers"
    if not local and w.max_seqlen > MAX_SEQLEN:
        return f"max_seqlen {w.max_seqlen} > {MAX_SEQLEN}, the Triton kernel's envelope on global layers " \
               "(FlashAttention wins there)"
    return None


def triton_short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, *, window: int | None, scale: float, dropout_p: float = 0.0,
                           key_lens: torch.Tensor | None = None, config: TileConfig | None = None,
                           rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Packed bidirectional attention forward, optionally with the rotary embedding of ``q, k`` fused in.

    Args:
        q, k, v: ``[T, heads, head_dim]`` fp16/bf16, same dtype, unit stride on the last dimension (any
            other strides, e.g. views of a fused ``[T, 3, heads, head_dim]`` projection).
        cu_seqlens: int32 ``[N + 1]`` on the same device, from 0 to ``T`` (empty sequences allowed).
        max_seqlen: host int, at least the longest sequence (it picks the tile shape and sizes the ``"seq"``
            grid; it is not read back from the device).
        window: half window (a query at i sees keys j with ``|i - j| <= window``) or ``None`` for global.
        scale: softmax scale.
        key_lens: optional int32 ``[N]``: only the first ``key_lens[s]`` rows of sequence ``s`` are keys (the
            rest are query-only; a row with no key in reach gets zeros, as torch SDPA).
        config: a launch shape; default :func:`tile_config`.
        rope: optional ``(cos, sin, rows)``: ``q, k`` are then unrotated (e.g. ``qkv.view(T, 3, heads, head_dim)``
            slices) and token ``t`` is rotated split-half with row ``rows[t]`` of the fp32 tables
            ``cos, sin`` ``[R, head_dim // 2]`` (``rows``: int32/int64 ``[T]``, every entry ``< R``; not
            checked, that would read the device), in fp32 and rounded to the dtype of ``q``, exactly as
            :func:`packed_encoders.ops.rope.rope_qkv_torch` before an unfused call. ``v`` is not rotated.

    Returns:
        ``[T, heads, head_dim]`` contiguous, dtype of ``q``.

    Raises:
        ValueError: attention dropout, inputs requiring grad (there is no backward, fused RoPE included), a
            dtype/shape/layout outside the kernel's contract, or non-CUDA tensors (CPU tensors run only under
            ``TRITON_INTERPRET=1``).
    """
    if dropout_p:
        raise ValueError("the Triton attention kernel has no attention dropout")
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one [T, heads, head_dim] shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must be one of {DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    total, heads, head_dim = q.shape
    if head_dim not in TILE_TABLE:
        raise ValueError(f"head_dim {head_dim} is not one of {HEAD_DIMS}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need unit stride on head_dim")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.stride(0) != 1:
        raise ValueError("cu_seqlens must be a contiguous 1-D int32 tensor")
    if not q.is_cuda and not interpret_enabled():
        raise ValueError("the Triton attention kernel needs CUDA tensors (CPU only under TRITON_INTERPRET=1)")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 or None (got {window})")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("the Triton attention kernel has no backward; run it under torch.no_grad() or use a "
                         "FlashAttention/sdpa backend for training")
    if key_lens is not None and (key_lens.dtype != torch.int32 or key_lens.shape != (cu_seqlens.numel() - 1,)):
        raise ValueError("key_lens must be int32 [N] (one entry per sequence)")
    cos = sin = rows = None
    if rope is not None:
        cos, sin, rows = _rope_args(rope, total, head_dim, q.device)
    if config is None and torch.compiler.is_compiling():
        return _custom_op()(q, k, v, cu_seqlens, int(max_seqlen), window, float(scale), key_lens, cos, sin, rows)
    return _launch(q, k, v, cu_seqlens, int(max_seqlen), window, float(scale), config, key_lens, cos, sin, rows)


def _rope_args(rope, total: int, head_dim: int, device: torch.device):
    """``(cos, sin, rows)`` checked and laid out for the kernel: the tables with unit column stride and one row
    stride (the forward's tables already are: no copy), ``rows`` contiguous. Metadata only (a few microseconds
    of host time per layer matter on short batches)."""
    try:
        cos, sin, rows = rope
    except (TypeError, ValueError):
        raise ValueError("rope must be a (cos, sin, rows) tuple") from None
    cs, ss = cos.shape, sin.shape
    if (cos.dtype is not torch.float32 or sin.dtype is not torch.float32 or len(cs) != 2 or cs != ss
            or cs[1] != head_dim // 2 or cos.device != device or sin.device != device):
        raise ValueError(f"rope cos, sin must be fp32 [R, {head_dim // 2}] tables on {device} (got {cos.dtype} "
                         f"{tuple(cs)} on {cos.device}, {sin.dtype} {tuple(ss)} on {sin.device})")
    if rows.dtype not in _ROW_DTYPES or rows.shape != (total,) or rows.device != device:
        raise ValueError(f"rope rows must be int32/int64 [{total}] on {device} (got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device})")
    cst, sst = cos.stride(), sin.stride()
    if cst[1] != 1 or cst != sst:
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin, rows.contiguous()


def _signature(q_dtype, cu_dtype, kl_dtype, rows_dtype, strides: tuple, head_dim: int, cfg: TileConfig, local: bool,
               has_kl: bool, largest_int: int, pointers: int) -> tuple:
    # what the compiled specialisation depends on: the strides are specialised ints (their values belong here),
    # the other ints are not (only their 32-bit range); ``pointers``: every pointer or-ed together
    return (q_dtype, cu_dtype, kl_dtype, rows_dtype, strides, head_dim, cfg, local, has_kl, largest_int < _I32_END,
            not pointers & 15)


def launcher(num_seqs: int, total: int, max_seqlen: int, heads: int, head_dim: int, window: int | None,
             scale: float, rows_dtype: torch.dtype, dtype: torch.dtype, device: int, stream: int):
    """The RoPE-fused kernel for raw device pointers, all 16-byte aligned: ``launch(qkv, out, cu_seqlens, cos, sin,
    rows)`` with ``q, k, v`` the three thirds of a contiguous fused projection ``qkv`` ``[total, 3 * heads *
    head_dim]`` of ``dtype`` (unrotated), ``out`` contiguous ``[total, heads, head_dim]``, int32 ``cu_seqlens``
    ``[num_seqs + 1]``, contiguous fp32 ``cos`` / ``sin`` ``[R, head_dim // 2]`` and ``rows`` ``[total]`` of
    ``rows_dtype``; on ``stream`` of CUDA device ``device``. ``None`` when no tensor launch bound that signature yet
    (see ``_runtime.launch_cached``)."""
    local = window is not None and window < max_seqlen - 1
    cfg = tile_config(max_seqlen, head_dim, local)
    tiles_per_seq = triton_cdiv(max_seqlen, cfg.block_m)
    width = heads * head_dim
    k_offset, v_offset = width * dtype.itemsize, 2 * width * dtype.itemsize
    strides = (3 * width, head_dim, 3 * width, head_dim, 3 * width, head_dim, width, head_dim, head_dim // 2)
    bound = _BOUND.get((device, _signature(dtype, torch.int32, torch.int32, rows_dtype, strides, head_dim, cfg, local,
                                           False, max(total, num_seqs * tiles_per_seq), 0)))
    if not bound:  # not bound yet (or unbindable: False)
        return None
    grid_rows = num_seqs * tiles_per_seq if cfg.grid == "seq" else triton_cdiv(total, cfg.block_m)
    run = bound.at(grid_rows, triton_cdiv(heads, cfg.heads_per_program), 1, stream)
    ints = (scale * _LOG2E, total, num_seqs, max(0, math.ceil(math.log2(num_seqs))), int(window) if local else 0,
            tiles_per_seq, heads, *strides)

    def launch(qkv: int, out: int, cu_seqlens: int, cos: int, sin: int, rows: int) -> None:
        run(qkv, qkv + k_offset, qkv + v_offset, out, cu_seqlens, cu_seqlens, cos, sin, rows, *ints)

    return launch


def _launch(q, k, v, cu_seqlens, max_seqlen: int, window: int | None, scale: float, config: TileConfig | None,
            key_lens: torch.Tensor | None = None, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
            rows: torch.Tensor | None = None):
    total, heads, head_dim = q.shape
    out = torch.empty((total, heads, head_dim), dtype=q.dtype, device=q.device)
    n = cu_seqlens.numel() - 1
    if total == 0 or n <= 0:
        return out
    local = window is not None and window < max_seqlen - 1  # a band covering every sequence is global
    cfg = config or tile_config(max_seqlen, head_dim, local)
    tiles_per_seq = triton_cdiv(max_seqlen, cfg.block_m)
    grid_rows = n * tiles_per_seq if cfg.grid == "seq" else triton_cdiv(total, cfg.block_m)
    grid = (grid_rows, triton_cdiv(heads, cfg.heads_per_program))
    rope = cos is not None
    tensors = (q, k, v, out, cu_seqlens, cu_seqlens if key_lens is None else key_lens) + ((cos, sin, rows) if rope
                                                                                          else ())
    ints = (scale * _LOG2E, total, n, max(0, math.ceil(math.log2(n))), int(window) if local else 0, tiles_per_seq,
            heads)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
               out.stride(1)) + ((cos.stride(0),) if rope else ())
    fast = sig = None
    if q.is_cuda:
        pointers = tuple(t.data_ptr() for t in tensors)
        fast = pointers + ints + strides
        sig = _signature(q.dtype, tensors[4].dtype, tensors[5].dtype, rows.dtype if rope else None, strides, head_dim,
                         cfg, local, key_lens is not None, max(total, n * tiles_per_seq), _runtime().or_all(pointers))
    _runtime().launch_cached(
        _BOUND, sig, _fast_kernel(rope) if q.is_cuda else _interpreted_kernel(rope), q, grid, tensors + ints + strides,
        dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEADS_PER_PROGRAM=cfg.heads_per_program,
             LOCAL=local, PER_SEQ=cfg.grid == "seq", DOT_F32=not q.is_cuda and q.dtype == torch.bfloat16,
             HAS_KL=key_lens is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages), fast)
    return out


@functools.lru_cache(maxsize=None)
def _custom_op():
    """``torch.ops.packed_encoders.triton_short_attention``: one opaque node (with a fake implementation) for
    ``torch.compile``. Eager calls launch directly: the dispatcher's overhead would be a large share of a
    short batch's time."""
    from torch.library import custom_op

    @custom_op("packed_encoders::triton_short_attention", mutates_args=(),
               schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, int? window, float scale,"
                      " Tensor? key_lens, Tensor? cos=None, Tensor? sin=None, Tensor? rope_rows=None) -> Tensor")
    def op(q, k, v, cu_seqlens, max_seqlen, window, scale, key_lens, cos=None, sin=None, rope_rows=None):
        return _launch(q, k, v, cu_seqlens, max_seqlen, window, scale, None, key_lens, cos, sin, rope_rows)

    @op.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, window, scale, key_lens, cos=None, sin=None, rope_rows=None):
        return q.new_empty(q.shape)  # contiguous, like the kernel's output

    return op


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_short_attention_direct(q, k, v, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
                                  dropout_p: float = 0.0, key_lens: torch.Tensor | None = None,
                                  rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`triton_short_attention` without its argument checks (each costs host time on every layer of a short
    batch): for the packed forward's no-grad path, whose ``q, k, v`` (views of the fused projection or the RoPE
    kernel's outputs), int32 ``cu_seqlens`` / ``key_lens`` and fp32 RoPE tables with contiguous ``rows`` meet the
    contract by construction. No dropout, no gradient."""
    if torch.compiler.is_compiling():
        return triton_short_attention(q, k, v, cu_seqlens, max_seqlen, window=window, scale=scale,
                                      dropout_p=dropout_p, key_lens=key_lens, rope=rope)
    if rope is None:
        return _launch(q, k, v, cu_seqlens, max_seqlen, window, scale, None, key_lens)
    cos, sin, rows = rope
    return _launch(q, k, v, cu_seqlens, max_seqlen, window, scale, None, key_lens, cos, sin, rows.contiguous())


register(Backend("triton", triton_short_attention, has_backward=False, supports_dropout=False,
                 availability=triton_status, envelope=envelope, supports_key_lens=True, fuses_rope=True,
                 direct=triton_short_attention_direct))
