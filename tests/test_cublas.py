"""ops/cublas.py on CPU: the column-major call it makes is the row-major product asked for (cuBLAS's semantics
emulated in PyTorch), and CPU tensors are not served (the caller's torch.mm runs)."""

import itertools

import pytest
import torch

from packed_encoders.ops import cublas


def _column_major(buf: torch.Tensor, ld: int, rows: int, cols: int) -> torch.Tensor:
    return torch.as_strided(buf, (rows, cols), (1, ld))


def _emulated_gemm(transa, transb, m, n, k, a_buf, lda, b_buf, ldb, ldc):
    """``C = op(A) @ op(B)`` as cublasGemmEx computes it: every matrix column-major in its flat buffer."""
    op_a = _column_major(a_buf, lda, m, k) if transa == 0 else _column_major(a_buf, lda, k, m).t()
    op_b = _column_major(b_buf, ldb, k, n) if transb == 0 else _column_major(b_buf, ldb, n, k).t()
    c_buf = torch.full((ldc * n,), float("nan"), dtype=torch.float64)
    _column_major(c_buf, ldc, m, n).copy_(op_a @ op_b)
    return c_buf


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
def test_the_column_major_call_computes_the_row_major_product(trans_a, trans_b):
    g = torch.Generator().manual_seed(0)
    rows, inner, cols = 5, 7, 3
    a = torch.randn((inner, rows) if trans_a else (rows, inner), generator=g, dtype=torch.float64)
    b = torch.randn((cols, inner) if trans_b else (inner, cols), generator=g, dtype=torch.float64)
    transa, transb, m, n, k, lda, ldb, ldc = cublas.gemm_args(tuple(a.shape), trans_a, tuple(b.shape), trans_b)
    # the module passes b first (cuBLAS's A) and a second (cuBLAS's B); C is the row-major [rows, cols] output
    c = _emulated_gemm(transa, transb, m, n, k, b.reshape(-1), lda, a.reshape(-1), ldb, ldc)
    expected = (a.t() if trans_a else a) @ (b.t() if trans_b else b)
    assert (m, n, k) == (cols, rows, inner)
    torch.testing.assert_close(c.view(rows, cols), expected, rtol=0, atol=1e-12)


def test_cpu_tensors_and_fp32_are_left_to_torch():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(6, 8, dtype=torch.bfloat16)
    assert cublas.mm(x, w, trans_b=True) is None
    assert cublas.mm(x.float(), w.float(), trans_b=True) is None
