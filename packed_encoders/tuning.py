"""`Tuning`: every environment switch and pack-time measurement, read once at ``pack()`` into one frozen object.

``pe.pack(model, ...)`` reads it (:func:`read_tuning`) and keeps it on the encoder's state; the router, the routes
and the kernel layer take their switches from it, never from the environment, so a call behaves as the model was
packed. The values reach ``ops/``, ``attention/`` and ``batch.py`` as arguments: the plan's
``packed_encoders.model.plan.Rules`` (``rules_for``), the op set built at ``pack()`` (quack's GEMM and RoPE
switches), the attention policy loaded at ``pack()``, the ``fused`` flag of the unpad. One switch is process-wide:
the Triton fast launcher (``ops.triton.set_fast_launch``), set by every ``pack()``. Calling
``pe.pack(model, ...)`` again re-reads it (and re-packs when anything changed); ``describe()`` shows it under
``"tuning"``. Direct users of ``ops/`` or ``attention/`` get the defaults of a default :class:`Tuning`.

Imports nothing from the package but the switch parsing rule and the error types, so every layer may use it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass

from .errors import PackedEncodersError
from .switches import switched_off

PREFIX = "PACKED_ENCODERS_"
GRAPH_ENV = "PACKED_ENCODERS_GRAPH"                  # =0: no CUDA graph replays (kill switch)
PRESTAGE_ENV = "PACKED_ENCODERS_GRAPH_PRESTAGE"      # =0: stage a graph's batch after the call's sync
FUSED_UNPAD_ENV = "PACKED_ENCODERS_FUSED_UNPAD"      # =0: unpad with PyTorch ops instead of two Triton launches
UNPAD_REUSE_ENV = "PACKED_ENCODERS_UNPAD_REUSE"      # =0: every padded call reads its lengths from the device
QUACK_GEMM_ENV = "PACKED_ENCODERS_QUACK_GEMM"        # =0: projections stay on cuBLAS
QUACK_ROPE_ENV = "PACKED_ENCODERS_QUACK_ROPE"        # =0: no RoPE in the q, k projection's epilogue
FAST_LAUNCH_ENV = "PACKED_ENCODERS_TRITON_FAST_LAUNCH"  # =0: Triton's own launcher
FUSED_ROPE_ENV = "PACKED_ENCODERS_FUSED_ROPE"        # =0: RoPE never fused into the attention kernel
FUSED_GLU_ENV = "PACKED_ENCODERS_FUSED_GLU_GEMM"     # =0: no small-batch Triton GEMMs (Wi + GLU, eager linears)
LEAN_ENV = "PACKED_ENCODERS_LEAN"                  # =0: the per-op checked path everywhere (A/B runs)
POLICY_ENV = "PACKED_ENCODERS_POLICY"                # an attention policy file, instead of the matched one
CACHE_ENV = "PACKED_ENCODERS_CACHE"                  # where calibrated policies live
GRAPH_MEMORY_ENV = "PACKED_ENCODERS_GRAPH_MEMORY"    # fraction of free GPU memory the graphs may hold

# each on / off switch and the Tuning field it sets
SWITCHES = {GRAPH_ENV: "graphs", PRESTAGE_ENV: "prestage", FUSED_UNPAD_ENV: "fused_unpad",
            UNPAD_REUSE_ENV: "unpad_reuse", QUACK_GEMM_ENV: "quack_gemm",
            QUACK_ROPE_ENV: "quack_rope", FAST_LAUNCH_ENV: "triton_fast_launch", FUSED_ROPE_ENV: "fused_rope",
            FUSED_GLU_ENV: "fused_glu_gemm", LEAN_ENV: "lean"}
KNOWN = (*SWITCHES, POLICY_ENV, CACHE_ENV, GRAPH_MEMORY_ENV)

DEFAULT_GRAPH_MEMORY_FRACTION = 0.1


@dataclass(frozen=True)
class Tuning:
    """The switches and budgets one packed encoder runs with (read at ``pack()``; frozen).

    Attributes:
        graphs: CUDA-graph replay allowed (``PACKED_ENCODERS_GRAPH`` not off).
        prestage: a graph call copies its batch into the inbox before its host sync.
        fused_unpad: padded calls unpad with the Triton kernels where they can.
        unpad_reuse: a padded call with gradients over the very input tensors of an earlier no-grad call in train
            mode, unchanged, takes that call's lengths without a host sync (``batch.LengthsMemo``; GradCache's
            second forward of a chunk).
        quack_gemm, quack_rope: quack's GEMMs (and the RoPE epilogue of the q, k projection) in the op set
            built at ``pack()``.
        triton_fast_launch: the Triton fast launcher (process-wide; the last ``pack()`` sets it).
        fused_rope, fused_glu_gemm: RoPE fused into the attention kernel; the small-batch Triton GEMMs (``Wi``
            with its GLU, and the other projections of eager calls) (the plan's ``Rules``).
        lean: unchecked launches and per-block autograd where they apply (``PACKED_ENCODERS_LEAN``; off: the
            per-op checked path everywhere).
        policy_file: ``PACKED_ENCODERS_POLICY`` (``None``: the policy matched to the card).
        cache_dir: ``PACKED_ENCODERS_CACHE``.
        graph_memory_fraction: the fraction of free GPU memory the encoder's graphs may hold (their LRU budget).
        free_memory_bytes: free memory on the model's CUDA device at ``pack()`` (``None``: not on CUDA then;
            measured at the first capture instead).
        env: every ``PACKED_ENCODERS_*`` variable set at ``pack()``, as ``(name, value)`` pairs (``describe()``
            lists those that name no switch, warned about and ignored, under ``ignored_env``).
    """

    graphs: bool = True
    prestage: bool = True
    fused_unpad: bool = True
    unpad_reuse: bool = True
    quack_gemm: bool = True
    quack_rope: bool = True
    triton_fast_launch: bool = True
    fused_rope: bool = True
    fused_glu_gemm: bool = True
    lean: bool = True
    policy_file: str | None = None
    cache_dir: str | None = None
    graph_memory_fraction: float = DEFAULT_GRAPH_MEMORY_FRACTION
    free_memory_bytes: int | None = None
    env: tuple = ()

    def graph_budget_bytes(self, free_bytes: int | None = None) -> int | None:
        """The graphs' memory budget: ``graph_memory_fraction`` of the free memory measured at ``pack()`` (or of
        ``free_bytes``, measured at the first capture, for a model moved to CUDA after ``pack()``)."""
        free = self.free_memory_bytes if self.free_memory_bytes is not None else free_bytes
        return None if free is None else int(free * self.graph_memory_fraction)

    def describe(self) -> dict:
        out = asdict(self)
        out["env"] = dict(self.env)
        out["ignored_env"] = _ignored(self.env)  # (warned at pack())
        out["read"] = "at pack(); pe.pack(model, ...) again re-reads"
        return out


def _ignored(env: tuple) -> list:
    """The names among ``env``'s ``(name, value)`` pairs that are none of :data:`KNOWN` (misspellings)."""
    return [name for name, _ in env if name not in KNOWN]


def _fraction(value: str | None) -> float:
    if value is None or not value.strip():
        return DEFAULT_GRAPH_MEMORY_FRACTION
    try:
        fraction = float(value)
    except ValueError:
        fraction = float("nan")
    if not 0.0 < fraction <= 1.0:
        raise PackedEncodersError(f"{GRAPH_MEMORY_ENV}={value!r}: expected a fraction in (0, 1] of free GPU memory")
    return fraction


def _policy_file(value: str | None) -> str | None:
    if not value:
        return None
    if not os.path.isfile(value):
        raise PackedEncodersError(f"{POLICY_ENV}={value!r}: no such file (an attention policy written by "
                                  "python -m packed_encoders.calibrate)")
    return value


def read_tuning(device=None) -> Tuning:
    """Read every switch now; with a CUDA ``device``, measure its free memory (one ``cudaMemGetInfo``). A
    ``PACKED_ENCODERS_*`` variable that names none of the switches (a misspelling) is warned about.

    Raises:
        PackedEncodersError: a switch set to something other than an off or on value (``switches``),
            ``PACKED_ENCODERS_GRAPH_MEMORY`` not a fraction in (0, 1], ``PACKED_ENCODERS_POLICY`` not a file.
    """
    try:
        switches = {field: not switched_off(name) for name, field in SWITCHES.items()}
    except ValueError as exc:
        raise PackedEncodersError(str(exc)) from None
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(PREFIX)))
    unknown = _ignored(env)
    if unknown:
        warnings.warn(f"packed_encoders: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not among its "
                      f"environment variables ({', '.join(KNOWN)}): ignored", UserWarning, stacklevel=3)
    policy_file = _policy_file(os.environ.get(POLICY_ENV))
    fraction = _fraction(os.environ.get(GRAPH_MEMORY_ENV))
    free = None
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        free = int(torch.cuda.mem_get_info(device)[0])
    return Tuning(
        **switches,
        policy_file=policy_file,
        cache_dir=os.environ.get(CACHE_ENV) or None,
        graph_memory_fraction=fraction,
        free_memory_bytes=free,
        env=env,
    )


def same_switches(a: Tuning, b: Tuning) -> bool:
    """Whether two readings agree on everything but the free-memory measurement (which moves between calls)."""
    return {**asdict(a), "free_memory_bytes": None} == {**asdict(b), "free_memory_bytes": None}
