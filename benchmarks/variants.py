"""The variants every runner compares, each run in a fresh process.

=====================  ===================================================================================
variant                what runs
=====================  ===================================================================================
hf_eager               stock HF, ``attn_implementation="eager"``
hf_sdpa                stock HF, ``attn_implementation="sdpa"`` (the baseline users get by default)
compile                stock HF sdpa with ``torch.compile(mode="max-autotune", dynamic=True)`` on the encoder,
                       cold caches (fresh process, fresh inductor cache dir); compile cost is in ``first_pass_s``
pack                   ``pe.pack(target)``: the default call, no options (CUDA graphs on automatically), same padded
                       calls as stock; its rows lead the tables
pack_<backend>         ``pe.pack(target, attention_backend=<backend>)`` for sdpa / varlen / fa4 / triton
pack_graphs            ``pe.pack(target, cuda_graph=True)`` where this build has it (explicit graphs: validated at pack)
pack_eager             ``pe.pack(target, cuda_graph=False)``: the eager packed forward
pack_graphs_sync_free  ``pe.pack(target, cuda_graph=GraphConfig(sync_free=True))``: rectangular graphs with no
                       host sync per padded call (input errors reported one call late), where this build has it
packed                 ``pe.pack(target)`` then ``pe.packed_forward`` on batches from a padding-free collator
=====================  ===================================================================================
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from benchmarks.common import segment_mean

BACKEND_VARIANTS = ("pack_sdpa", "pack_varlen", "pack_fa4", "pack_triton")
VARIANTS = ("hf_eager", "hf_sdpa", "compile", "pack", "pack_eager", *BACKEND_VARIANTS, "pack_graphs",
            "pack_graphs_sync_free", "packed")
# Variants whose first-pass time is a result (compile / capture): a fresh process per endpoint too.
COLD_START_VARIANTS = ("compile", "pack", "pack_graphs", "pack_graphs_sync_free")
# The default sweep of ``--quick`` on CPU (a smoke run: each child costs ~15 s of imports there).
QUICK_CPU_VARIANTS = ("hf_sdpa", "pack", "packed")


def attention_for(variant: str) -> str:
    """HF ``attn_implementation`` the model is loaded with for ``variant``."""
    return "eager" if variant == "hf_eager" else "sdpa"


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    return names


def why_skip(variant: str, device: str, dtype: torch.dtype, config, quick: bool, explicit: bool) -> str | None:
    """Why ``variant`` cannot (or will not) run here, checked in the parent without a model, or ``None``.

    ``explicit``: the user listed the variants (the ``--quick`` CPU smoke subset does not apply).
    """
    import packed_encoders as pe

    smoke = quick and not device.startswith("cuda") and not explicit
    if variant == "compile" and smoke:
        return "skipped under --quick on CPU: a cold torch.compile(max-autotune) builds C++ kernels for minutes"
    if variant in ("pack_graphs", "pack_graphs_sync_free"):
        if "cuda_graph" not in inspect.signature(pe.pack).parameters:
            return "not available: pe.pack(cuda_graph=...) does not exist in this build"
        if variant == "pack_graphs_sync_free" and "sync_free" not in getattr(pe.GraphConfig, "__dataclass_fields__", {}):
            return "not available: GraphConfig(sync_free=...) does not exist in this build"
        if not device.startswith("cuda"):
            return "CUDA graphs need a CUDA device"
    if variant in BACKEND_VARIANTS:
        from packed_encoders.attention.backends import BACKENDS, Workload

        name = variant.removeprefix("pack_")
        backend = BACKENDS.get(name)
        if backend is None:
            return f"attention backend {name!r} is not registered in this build"
        heads = config.num_attention_heads
        w = Workload(num_seqs=8, total_tokens=1024, max_seqlen=256, heads=heads,
                     head_dim=config.hidden_size // heads, window=None, grad=False, dtype=dtype,
                     device_type=torch.device(device).type)
        reason = backend.why_not(w)
        if reason is not None:
            return f"attention backend {name!r} cannot run here: {reason}"
    if smoke and variant not in QUICK_CPU_VARIANTS:
        return f"not in the --quick CPU smoke sweep ({', '.join(QUICK_CPU_VARIANTS)}); name it in --variants"
    return None


@dataclass
class Applied:
    """A variant applied to a family: ``step(batch) -> (tokens, pooled | None)`` and what it took."""

    step: Callable
    packed_inputs: bool
    setup_s: float
    info: dict = field(default_factory=dict)


def apply_variant(variant: str, family) -> Applied:
    """Transform ``family`` in place for ``variant`` and return its timed step."""
    import packed_encoders as pe

    t0 = time.perf_counter()
    info: dict = {}
    if variant in ("hf_eager", "hf_sdpa"):
        return Applied(lambda b: family.padded(b.input_ids, b.attention_mask), False, 0.0, info)
    if variant == "compile":
        family.encoder.compile(mode="max-autotune", dynamic=True)  # in place, == torch.compile(model, ...)
        info["compile"] = {"mode": "max-autotune", "dynamic": True, "target": type(family.encoder).__name__}
        return Applied(lambda b: family.padded(b.input_ids, b.attention_mask), False,
                       time.perf_counter() - t0, info)
    if variant == "pack_graphs":
        pe.pack(family.target, cuda_graph=True)
    elif variant == "pack_eager":
        pe.pack(family.target, cuda_graph=False)
    elif variant == "pack_graphs_sync_free":
        pe.pack(family.target, cuda_graph=pe.GraphConfig(sync_free=True))
    elif variant.startswith("pack_"):
        pe.pack(family.target, attention_backend=variant.removeprefix("pack_"))
    else:  # pack, packed
        pe.pack(family.target)
    setup = time.perf_counter() - t0
    info["describe"] = pe.describe(family.target)["encoders"]
    if variant != "packed":
        return Applied(lambda b: family.padded(b.input_ids, b.attention_mask), False, setup, info)

    params = pe.ModernBertParams.from_hf_config(family.encoder.config)

    def step(b):
        x = family.head(pe.packed_forward(family.target, params, b.input_ids, b.cu_seqlens, b.max_seqlen,
                                          b.position_ids))
        return x, (segment_mean(x, b.seq_index, b.lengths) if family.pools else None)

    return Applied(step, True, setup, info)


def refresh_describe(applied: Applied, family) -> None:
    """Record the attention choices made during the run (``last_attention`` is set by calls)."""
    if "describe" in applied.info:
        import packed_encoders as pe

        applied.info["describe"] = pe.describe(family.target)["encoders"]
