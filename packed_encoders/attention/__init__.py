"""Packed variable-length attention: reference, backends and dispatch. Never imports transformers."""

from .backends import BACKENDS, Backend, Workload, register
from .dispatch import CHOICES, Decision, Policy, resolve
from .reference import attention_ref
from . import triton_short  # noqa: F401  (registers backend "triton"; imports triton lazily)

__all__ = ["BACKENDS", "Backend", "CHOICES", "Decision", "Policy", "Workload", "attention_ref", "register", "resolve"]
