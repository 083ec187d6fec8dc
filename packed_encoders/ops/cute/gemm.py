"""quack CuteDSL GEMMs (sm90+): ModernBERT's ``Wi`` projection with its GLU in the epilogue, and plain ones.

``y = act(x @ W[:I].T) * (x @ W[I:].T)`` ``[M, I]`` from HF's own ``Wi`` weight ``[2I, K]``: the ``[M, 2I]``
intermediate is never written and the separate GLU launch is gone. quack's GEMM reads the weight in place:
``concat_layout=("B",)`` views the concatenated ``[a; g]`` rows as interleaved pairs, so each accumulator
pair holds ``(a_j, g_j)`` and the epilogue writes ``act(a_j) * g_j`` once, rounded from fp32.

quack ships gated epilogues for SwiGLU / ReGLU and a GeGLU with the *tanh* approximation; ModernBERT's
``hidden_activation="gelu"`` is the exact erf GELU (HF ``GELUActivation``), so the epilogues here are our
own, written with quack's ``@gemm_epilogue`` (activations from ``quack.activation``: ``gelu_erf``,
``gelu_tanh_approx``, ``silu``, ``relu``).

Nothing here is imported until used (importing quack loads the CuteDSL compiler). Each (shape class,
config) compiles once per process, several seconds; compiled kernels are cached on disk by quack.
"""

from __future__ import annotations

import quack
import quack.activation as _qa
import torch
from quack.epilogue import gemm_epilogue, unpack


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


def glu_linear(x: torch.Tensor, weight: torch.Tensor, activation: str, config=None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ weight[:I].T) * (x @ weight[I:].T)`` ``[M, I]`` in ``x.dtype``.

    Args:
        x: ``[M, K]`` bf16/fp16 CUDA, K-contiguous.
        weight: ``[2I, K]`` (HF ``Wi.weight``, read in place), same dtype and device.
        activation: a key of :data:`EPILOGUES`.
        config: a ``quack.gemm_config.GemmConfig`` (``None``: quack's default for the GPU, no autotuning).
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
    EPILOGUES[activation](x, weight.t(), None, out={"postact": out}, store_d=False, config=config,
                          tuned=False, concat_layout=("B",))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` ``[M, N]`` in ``x.dtype`` with quack's GEMM (its default config for the GPU).

    ``x`` ``[M, K]`` and ``weight`` ``[N, K]`` (HF ``nn.Linear.weight``, read in place), bf16/fp16 CUDA."""
    from quack.gemm_interface import gemm

    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[0]))
    return gemm(x, weight.t(), tuned=False)
