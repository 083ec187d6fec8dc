"""Triton kernels for the per-token ops (LayerNorm, residual + LayerNorm, RoPE from fused qkv, GLU).

Importing this package imports Triton; ``packed_encoders.ops.fused`` wraps the launchers as
``torch.library`` custom ops. Nothing here is imported by ``import packed_encoders``.
"""
