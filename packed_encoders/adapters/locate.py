"""Find the ModernBERT encoders inside whatever the user holds.

Every ``nn.Module`` reachable through ``named_modules()`` is examined, which covers HF task heads
(``.model``), SentenceTransformer (``model[0].auto_model`` or ``model[0].model``), PyLate ColBERT and
sentence-transformers multi-vector models without naming their classes.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedTargetError
from ..model.params import SUPPORTED_MODEL_TYPES

_REQUIRED = ("embeddings", "layers", "final_norm")


def is_modernbert(module: object) -> bool:
    """True for a HF ``ModernBertModel`` (or a class of the same structure and model type): ``embeddings``,
    ``layers`` and ``final_norm`` are its own submodules."""
    if not isinstance(module, nn.Module):
        return False
    config = getattr(module, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    # its own submodules, not attributes: wrappers that forward attribute lookups to the model they hold (peft's
    # PeftModel / LoraModel, torch.compile's OptimizedModule) are not encoders; the model inside them is
    return all(name in module._modules for name in _REQUIRED)


def find_encoders(target: object) -> list[tuple[str, nn.Module]]:
    """All ``(path, ModernBertModel)`` pairs inside ``target``, outermost first, each module once.

    Raises:
        UnsupportedTargetError: ``target`` is not an ``nn.Module`` or holds no ModernBERT encoder.
    """
    if not isinstance(target, nn.Module):
        raise UnsupportedTargetError(
            f"expected a torch.nn.Module holding a ModernBertModel; got {type(target).__module__}."
            f"{type(target).__qualname__}")
    found: list[tuple[str, nn.Module]] = []
    seen_types: set[str] = set()
    for path, module in target.named_modules():
        if is_modernbert(module):
            if not any(path.startswith(p + ".") for p, _ in found if p):
                found.append((path, module))
        elif len(seen_types) < 12:
            seen_types.add(type(module).__name__)
    if not found:
        raise UnsupportedTargetError(
            f"no ModernBertModel (config.model_type in {SUPPORTED_MODEL_TYPES} with "
            f"{'/'.join(_REQUIRED)}) inside {type(target).__name__}; searched every submodule via "
            f"named_modules(), seeing types: {', '.join(sorted(seen_types))}")
    return found
