"""CPU tests of ``attention/fa4_direct.py``'s bookkeeping with a stand-in interface (no FlashAttention-4 here):
spans, layout checks, what a recording accepts and rejects, the substitution of a call's tensors and the backward's
scratch geometry, and the eager policy's demotion of FlashAttention-4 where its direct calls do not serve."""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch

from packed_encoders.attention import Workload, dispatch, fa4_direct


def test_spans_cover_each_max_seqlen_once():
    assert fa4_direct.span_of(1) == (1, 64)
    assert fa4_direct.span_of(64) == (1, 64)
    assert fa4_direct.span_of(65) == (65, 128)
    assert fa4_direct.span_of(193) == (193, 256)
    assert fa4_direct.span_of(8192) == (4097, 8192)
    assert fa4_direct.span_of(fa4_direct.SPANS[-1] + 1) is None
    for n in (1, 2, 100, 129, 1000, 40000):
        lo, hi = fa4_direct.span_of(n)
        assert lo <= n <= hi


def test_aligned_wants_what_the_kernels_take_without_a_copy():
    x = torch.zeros(10, 12, 64, dtype=torch.bfloat16)
    assert fa4_direct.aligned(x)
    assert fa4_direct.aligned(torch.zeros(10, 3, 12, 64, dtype=torch.bfloat16).unbind(1)[1])  # a qkv view
    assert not fa4_direct.aligned(torch.zeros(10, 12, 65, dtype=torch.bfloat16)[..., :64])  # row stride 65
    assert not fa4_direct.aligned(x.transpose(1, 2))  # last dimension strided
    assert not fa4_direct.aligned(torch.zeros(10, 1, 64, dtype=torch.bfloat16).expand(10, 12, 64))  # broadcast
    flat = torch.zeros(10 * 12 * 64 + 1, dtype=torch.bfloat16)
    assert not fa4_direct.aligned(flat[1:].view(10, 12, 64))  # 2-byte offset


class _Cache(dict):
    pass


def _fake_interface(log: list, temp_shape=None):
    """A stand-in for ``flash_attn.cute.interface``: a forward making one compiled call, a backward making three,
    with scratch buffers the way the real one allocates them (or a tensor of its own: ``temp_shape``)."""
    def compiled(name):
        def fn(*args):
            log.append((name, args))
        return fn

    def _flash_attn_fwd(q, k, v, *, cu_seqlens_q, out, lse, softmax_scale, window_size_left, **_):
        key = ("fwd", window_size_left is None)
        if key not in _flash_attn_fwd.compile_cache:
            _flash_attn_fwd.compile_cache[key] = compiled("fwd")
        extra = torch.empty(temp_shape) if temp_shape else None
        _flash_attn_fwd.compile_cache[key](q, k, v, out, lse, softmax_scale, cu_seqlens_q, cu_seqlens_q, None,
                                           window_size_left, window_size_left, extra)

    def _flash_attn_bwd(q, k, v, out, dout, lse, scale, causal, softcap, *, cu_seqlens_q, dq, dk, dv, **_):
        heads, total = q.shape[1], q.shape[0]
        padded = (total + cu_seqlens_q.shape[0] * 128 - 1) // 128 * 128
        dpsum, lse_log2 = torch.empty(heads, padded), torch.empty(heads, padded)
        acc = torch.empty(heads, padded * 64)
        for name, args in (("pre", (out, dout, dpsum, lse, lse_log2, acc, cu_seqlens_q)),
                           ("bwd", (q, k, v, dout, lse_log2, dpsum, acc, dk, dv, scale, cu_seqlens_q)),
                           ("post", (acc, dq, scale, cu_seqlens_q))):
            cache = getattr(iface, "_" + name).compile_cache
            if name not in cache:
                cache[name] = compiled(name)
            cache[name](*args)

    iface = types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd,
                                  _pre=lambda: None, _bwd=lambda: None, _post=lambda: None)
    for fn in (_flash_attn_fwd, iface._pre, iface._bwd, iface._post):
        fn.compile_cache = _Cache()
    return iface


def test_a_recording_substitutes_the_calls_tensors_and_sizes_the_backward_scratch():
    log: list = []
    iface = _fake_interface(log)
    q = torch.zeros(1, 12, 64)
    fwd, bwd = fa4_direct._record_one(q, 40, None, 0.125, True, (128, 64), interface=iface)
    fwd2, bwd2 = fa4_direct._record_one(q, 64, None, 0.125, True, (128, 64), interface=iface)
    assert fa4_direct._same(fwd, fwd2) and fa4_direct._same(bwd, bwd2)
    kernels = fa4_direct._Kernels(fwd, bwd, 128, 64)
    log.clear()
    lengths = [5, 300, 20]
    total = sum(lengths)
    qq, kk, vv, out = (torch.randn(total, 12, 64) for _ in range(4))
    lse = torch.empty(12, total)
    cu = torch.tensor([0, 5, 305, 325], dtype=torch.int32)
    kernels.run_forward(qq, kk, vv, out, lse, cu)
    (name, args), = log
    assert name == "fwd" and args[0] is qq and args[1] is kk and args[2] is vv and args[3] is out and args[4] is lse
    assert args[5] == 0.125 and args[6] is cu and args[9] is None and args[11] is None
    log.clear()
    dout, dq, dk, dv = (torch.randn(total, 12, 64) for _ in range(4))
    kernels.run_backward(dout, qq, kk, vv, out, lse, cu, dq, dk, dv)
    (pre, pargs), (main, margs), (post, targs) = log
    padded = (total + 4 * 128 - 1) // 128 * 128
    assert (pre, main, post) == ("pre", "bwd", "post")
    assert pargs[0] is out and pargs[1] is dout and pargs[3] is lse and pargs[6] is cu
    assert pargs[2].shape == (12, padded) and pargs[4].shape == (12, padded) and pargs[5].shape == (12, padded * 64)
    assert margs[4] is pargs[4] and margs[5] is pargs[2] and margs[6] is pargs[5] and targs[0] is pargs[5]
    assert margs[7] is dk and margs[8] is dv and targs[1] is dq
    # the three scratch buffers do not overlap
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in (pargs[2], pargs[4], pargs[5]))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_a_recording_hides_cutlass_jit_argument_warnings_only():
    """cutlass-dsl warns at each FA4 compile that flash_attn.cute's AuxData "cannot be converted to a JitArgument"
    (harmless): a recording, which compiles on a user's first call, hides that warning and no other."""
    def warning_interface(message):
        iface = _fake_interface([])
        forward = iface._flash_attn_fwd

        def _flash_attn_fwd(*args, **kwargs):
            warnings.warn(message, UserWarning)
            return forward(*args, **kwargs)

        iface._flash_attn_fwd, iface._compiling_forward = _flash_attn_fwd, forward  # (the recorder wraps its cache)
        return iface

    noise = ("Argument aux_data (position 17) cannot be converted to a JitArgument for function 'cutlass___call___"
             "flash_attncuteflash_fwd_sm90'. Its type `<class 'flash_attn.cute.utils.AuxData'>` is not supported.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa4_direct._record_one(torch.zeros(1, 12, 64), 40, None, 0.125, True, (128, 64),
                               interface=warning_interface(noise))
    with pytest.warns(UserWarning, match="something else"):
        fa4_direct._record_one(torch.zeros(1, 12, 64), 40, None, 0.125, False, (128, 64),
                               interface=warning_interface("something else"))


def test_quiet_compile_hides_deprecations_raised_in_flash_attn_and_cutlass_only():
    """flash_attn.cute's sm_90 kernels use names cutlass-dsl deprecates: under strict warnings their first compile
    (pack()'s validation) raised. Hidden when flash_attn's or cutlass' code raises them or they name the
    deprecated warpgroup names; others still raise."""
    def deprecation(module, message="cute.Foo is deprecated"):
        warnings.warn_explicit(message, DeprecationWarning, "x.py", 1, module=module)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fa4_direct.quiet_compile():
            deprecation("flash_attn.cute.flash_fwd_sm90")
            deprecation("cutlass.cute.nvgpu.warpgroup")
            deprecation("<string>", "warpgroup.OperandMajorMode is deprecated, use cute.nvgpu.OperandMajorMode")
            for module in ("mine", "flash_attn_plus", "tests.cutlass"):
                with pytest.raises(DeprecationWarning):
                    deprecation(module)
            with pytest.raises(UserWarning):
                warnings.warn_explicit("something else", UserWarning, "x.py", 1, module="flash_attn.cute.interface")
        with pytest.raises(DeprecationWarning):  # only inside
            deprecation("flash_attn.cute.flash_fwd_sm90")


def test_a_recording_refuses_tensors_the_interface_made_itself():
    iface = _fake_interface([], temp_shape=(3,))
    with pytest.raises(ValueError, match="made itself"):
        fa4_direct._record_one(torch.zeros(1, 12, 64), 40, None, 0.125, False, (128, 64), interface=iface)
    # and scratch buffers of another geometry than the one this module allocates
    iface = _fake_interface([])
    with pytest.raises(ValueError, match="dq_accum"):
        fa4_direct._record_one(torch.zeros(1, 12, 64), 40, None, 0.125, True, (128, 32), interface=iface)


def test_recorded_calls_of_different_kernels_are_not_the_same():
    f, g = (lambda *a: None), (lambda *a: None)
    a = (fa4_direct._Call(f, (None, 0.125), ((0, 0),)),)
    assert fa4_direct._same(a, (fa4_direct._Call(f, (None, 0.125), ((0, 0),)),))
    assert not fa4_direct._same(a, (fa4_direct._Call(g, (None, 0.125), ((0, 0),)),))
    assert not fa4_direct._same(a, (fa4_direct._Call(f, (None, 0.25), ((0, 0),)),))
    assert not fa4_direct._same(a, (fa4_direct._Call(f, (None, 0.125), ((0, 1),)),))


def _workload(graph: bool, num_seqs=8, max_seqlen=1000) -> Workload:
    return Workload(num_seqs=num_seqs, total_tokens=num_seqs * max_seqlen, max_seqlen=max_seqlen, heads=12,
                    head_dim=64, window=None, grad=True, dtype=torch.bfloat16, device_type="cuda", graph=graph)


def test_eager_calls_put_fa4_after_fa2_where_its_direct_calls_do_not_serve(monkeypatch):
    table = dispatch.Table(True, "global", ((None, (dispatch.Cell(None, ("fa4", "varlen", "sdpa")),)),))
    policy = dispatch.Policy("test", (table, dispatch.Table(True, "global", table.rows, graph=True)))
    for backend in ("fa4", "varlen"):  # both runnable here, whatever this machine has
        monkeypatch.setitem(dispatch.BACKENDS, backend,
                            dataclasses.replace(dispatch.BACKENDS[backend], availability=lambda: None))
    monkeypatch.setattr(fa4_direct, "workload_status", lambda num_seqs, max_seqlen: None)
    assert dispatch.resolve("auto", _workload(False), policy).backend == "fa4"
    monkeypatch.setattr(fa4_direct, "workload_status", lambda num_seqs, max_seqlen: "another release")
    assert dispatch.resolve("auto", _workload(False), policy).backend == "varlen"
    assert dispatch.resolve("auto", _workload(True), policy).backend == "fa4"  # a graph replays without host cost
    big = _workload(False, num_seqs=64, max_seqlen=dispatch.FA4_PUBLIC_MIN_TOKENS // 32)
    assert dispatch.resolve("auto", big, policy).backend == "fa4"  # GPU-bound: the planning is paid back


def test_workload_status_names_batches_and_lengths_it_does_not_serve(monkeypatch):
    monkeypatch.setattr(fa4_direct, "version_status", lambda: None)
    assert fa4_direct.workload_status(8, 1000) is None
    assert "sequences" in fa4_direct.workload_status(fa4_direct.MAX_BATCH + 1, 10)
    assert "span" in fa4_direct.workload_status(1, fa4_direct.SPANS[-1] + 1)


def test_the_backward_copies_an_output_gradient_the_kernels_cannot_take(monkeypatch):
    seen = []
    calls = (fa4_direct._Call(lambda *a: seen.append(a[0]), (None,), ((0, fa4_direct._INDEX["dout"]),)),)
    q = torch.zeros(7, 12, 64, dtype=torch.bfloat16)
    kernels = fa4_direct._Kernels(calls, calls, 128, 64)
    monkeypatch.setattr(fa4_direct, "kernels", lambda *args: kernels)
    cu = torch.tensor([0, 7], dtype=torch.int32)
    flat = torch.randn(7 * 12 * 64 + 1).to(torch.bfloat16)
    for dout in (flat[1:].view(7, 12, 64), torch.randn(1, 12, 64).to(torch.bfloat16).expand(7, 12, 64)):
        assert not fa4_direct.aligned(dout)
        fa4_direct.backward(dout, q, q, q, q, torch.zeros(12, 7), cu, 7, window=None, scale=0.125)
        assert seen[-1] is not dout and fa4_direct.aligned(seen[-1]) and torch.equal(seen[-1], dout)


def test_callers_buffers_are_written_and_scratch_is_kept_per_geometry(monkeypatch):
    log: list = []
    iface = _fake_interface(log)
    q = torch.zeros(1, 12, 64)
    fwd, bwd = fa4_direct._record_one(q, 64, None, 0.125, True, (128, 64), interface=iface)
    kernels = fa4_direct._Kernels(fwd, bwd, 128, 64)
    monkeypatch.setattr(fa4_direct, "kernels", lambda *args: kernels)
    total = 40
    cu = torch.tensor([0, 15, total], dtype=torch.int32)
    qq, kk, vv = (torch.randn(total, 12, 64) for _ in range(3))
    out, lse = torch.empty(total, 12, 64), torch.empty(12, total)
    log.clear()
    assert fa4_direct.forward(qq, kk, vv, cu, 64, window=None, scale=0.125, out=out, lse=lse) == (out, lse)
    assert log[0][1][3] is out and log[0][1][4] is lse
    with pytest.raises(ValueError, match="lse"):
        fa4_direct.forward(qq, kk, vv, cu, 64, window=None, scale=0.125, lse=torch.empty(total, 12))
    grads, scratch = tuple(torch.empty(total, 12, 64) for _ in range(3)), {}
    seen = []
    for _ in range(2):
        log.clear()
        got = fa4_direct.backward(torch.randn(total, 12, 64), qq, kk, vv, out, lse, cu, 64, window=None,
                                  scale=0.125, grads=grads, scratch=scratch)
        (_, pargs), (_, margs), (_, targs) = log
        assert got is grads and targs[1] is grads[0] and margs[7] is grads[1] and margs[8] is grads[2]
        seen.append((pargs[2], pargs[4], pargs[5]))
    assert len(scratch) == 1 and all(a is b for a, b in zip(*seen))  # the second call reused the first's scratch
    log.clear()
    fa4_direct.backward(torch.randn(total, 12, 64), qq, kk, vv, out, lse, cu, 64, window=None, scale=0.125)
    assert not any(log[0][1][2] is t for t in seen[0])  # without a dict: buffers of its own
    with pytest.raises(ValueError, match="grads"):
        fa4_direct.backward(torch.randn(total, 12, 64), qq, kk, vv, out, lse, cu, 64, window=None, scale=0.125,
                            grads=(grads[0], grads[1], torch.empty(total, 12, 32)))
