"""The packed ModernBERT forward as a pure function over the live HF modules."""

from .forward import encoder_forward, plan_attention
from .params import ModernBertParams

__all__ = ["ModernBertParams", "encoder_forward", "plan_attention"]
