"""packed_encoders: a padding-free forward for live Hugging Face ModernBERT encoders.

    import packed_encoders as pe
    pe.pack(model)      # model: ModernBertModel, ModernBertFor*, SentenceTransformer, PyLate ColBERT
    pe.unpack(model)

Importing this package needs only torch; it compiles nothing and works without CUDA.
"""

from .distributed import grad_cache_sync
from .api import describe, is_packed, pack, packed_forward, unpack
from .errors import PackedEncodersError, UnsupportedTargetError, ValidationError
from .controls import check_errors, no_cuda_graph, set_cuda_graph
from .graphs import GraphConfig
from .model.params import ModernBertParams
from .validation import ValidationReport, validate

__version__ = "0.1.0"

__all__ = [
    "GraphConfig", "ModernBertParams", "PackedEncodersError", "UnsupportedTargetError", "ValidationError", "ValidationReport",
    "check_errors", "describe", "grad_cache_sync", "is_packed", "no_cuda_graph", "pack", "packed_forward", "set_cuda_graph", "unpack", "validate",
]
