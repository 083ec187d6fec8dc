"""The forward plan (model/plan.py): which implementation each step takes, decided once per call class, and the
unchecked (direct) Triton launches against the checked per-op path (interpreted on CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpret")

from packed_encoders.attention.dispatch import Decision  # noqa: E402
from packed_encoders.batch import unpad  # noqa: E402
from packed_encoders.model import plan as plan_mod  # noqa: E402
from packed_encoders.model.forward import encoder_forward  # noqa: E402
from packed_encoders.model.params import ModernBertParams  # noqa: E402
from packed_encoders.ops import TORCH_OPS  # noqa: E402
from tests.conftest import make_model, padded_batch  # noqa: E402


@pytest.fixture(scope="module")
def fused():
    from packed_encoders.ops import fused

    return fused


def _batch(model, lengths):
    ids, mask = padded_batch(lengths, side="mixed")
    return unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                 vocab_size=model.config.vocab_size)


def _sdpa(params):
    return {None: Decision("sdpa"), params.window: Decision("sdpa")}


def test_direct_launches_match_checked_ops(fused):
    """No gradient: the plan launches the Triton kernels unchecked, with the same outputs as the checked per-op
    path (lean off) and nothing recorded as a fallback."""
    model = make_model("odd")  # biases everywhere, tanh GELU
    params = ModernBertParams.from_hf_config(model.config)
    batch = _batch(model, [9, 30, 4])
    fused.reset_fallbacks()
    with torch.no_grad():
        # the projections on F.linear, as the checked path has them: the same launches, bit for bit
        lean_cublas = encoder_forward(model, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa",
                                      rules=plan_mod.Rules(lean=True, small_linear_max_tokens=0))
        lean = encoder_forward(model, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa",
                               rules=plan_mod.Rules(lean=True))
        checked = encoder_forward(model, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa",
                                  rules=plan_mod.Rules(lean=False))
        plain = encoder_forward(model, params, batch, ops=TORCH_OPS, attention_backend="sdpa")
    assert fused.fallbacks() == {}
    torch.testing.assert_close(lean_cublas, checked, atol=0, rtol=0)
    torch.testing.assert_close(lean, plain, atol=2e-5, rtol=2e-5)  # the Triton projections: same maths
    assert (lean - lean_cublas).abs().max() > 0  # ... which ran (another summation order)
    p = plan_mod.plan_for(params, fused.TRITON_OPS, _sdpa(params), tokens=batch.total_tokens,
                          max_seqlen=batch.max_seqlen, dtype=torch.float32, device=batch.device, grad=False)
    assert p.direct and p.ops is fused.DIRECT_OPS and p.glu == "small_gemm" and p.linear is fused.DIRECT_OPS.linear
    assert plan_mod.plan_for(params, fused.TRITON_OPS, _sdpa(params), tokens=batch.total_tokens,
                             max_seqlen=batch.max_seqlen, dtype=torch.float32, device=batch.device,
                             grad=False) is p  # cached per call class


def test_plan_choices_follow_the_rules(fused):
    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    cpu = torch.device("cpu")

    def plan(tokens, grad=False, rules=None, ops=fused.TRITON_OPS, max_seqlen=40):
        return plan_mod.plan_for(params, ops, _sdpa(params), tokens=tokens, max_seqlen=max_seqlen,
                                 dtype=torch.float32, device=cpu, grad=grad, rules=rules)

    assert plan(9000).glu == "split"  # past the small GEMMs' size rules (eager: Rules.glu_eager_max_tokens)
    assert plan(5000).glu == "small_gemm"  # past small_linear_max_tokens: Wi + GLU still one Triton GEMM
    assert plan(300).glu == "small_gemm"  # past glu_gemm_max_tokens, but an eager call: host-bound
    # projections: the Triton GEMM for small eager calls (host-bound), F.linear past the size rule, with gradient
    # or with the switch off (PACKED_ENCODERS_FUSED_GLU_GEMM=0 at pack())
    assert plan(100).linear is fused.DIRECT_OPS.linear and plan(5000).linear is torch.nn.functional.linear
    assert (plan(100).linear_route, plan(5000).linear_route) == ("small_gemm", "F.linear")  # what describe() shows
    assert plan(100, rules=plan_mod.Rules(small_linear_max_tokens=0)).linear is torch.nn.functional.linear
    assert plan(100, grad=True).linear is torch.nn.functional.linear
    assert plan(100, rules=plan_mod.Rules(lean=False)).linear is torch.nn.functional.linear
    # a CUDA graph's warm-up runs what its capture will bake in: cuBLAS (plans are built without touching CUDA)
    from packed_encoders.ops import quack_gemm

    with quack_gemm.graph_rules():
        warm = plan_mod.plan_for(params, fused.TRITON_OPS, _sdpa(params), tokens=100, max_seqlen=40,
                                 dtype=torch.bfloat16, device=torch.device("cuda"), grad=False)
    assert warm.direct and warm.glu == "small_gemm" and warm.linear is torch.nn.functional.linear
    off = plan_mod.Rules(glu_gemm_max_tokens=0, small_linear_max_tokens=0, glu_eager_max_tokens=0)
    assert plan(100, rules=off).glu == "split"
    assert plan(100, rules=plan_mod.Rules(glu_gemm_max_tokens=0)).glu == "small_gemm"  # eager: the other rules
    assert plan(100, rules=plan_mod.Rules(glu_gemm_max_tokens=0, glu_eager_max_tokens=0)).glu == "small_gemm"
    # the checked path routes through the checked op, unless PACKED_ENCODERS_FUSED_GLU_GEMM=0 (read at pack())
    assert plan(5000, rules=plan_mod.Rules(lean=False)).glu == "route"
    assert plan(100, rules=plan_mod.Rules(lean=False, glu_gemm_max_tokens=0)).glu == "split"
    assert plan(100, rules=plan_mod.Rules(lean=False)).why_checked.startswith("PACKED_ENCODERS_LEAN is off")
    assert plan(100).direct and plan(100).why_checked is None
    g = plan(100, grad=True)
    assert not g.direct and g.ops is fused.TRITON_OPS and g.glu == "split"
    assert g.why_checked.startswith("gradients wanted")
    assert plan(100, ops=TORCH_OPS).ops is TORCH_OPS and not plan(100, ops=TORCH_OPS).direct
    # every layer's window: a band covering every sequence is global
    assert [lp.window for lp in plan(100).layers] == [params.layer_window(i) for i in range(4)]
    assert all(lp.window is None for lp in plan(100, max_seqlen=params.window + 1).layers)
    assert not any(lp.rope_linear or lp.rope_in_attention for lp in plan(100).layers)  # sdpa does not fuse RoPE


def test_triton_cover_reasons(fused):
    cpu = torch.device("cpu")
    assert fused.covers(cpu, torch.float32, 128, 2, 64, "gelu") is None  # interpreting
    assert "activation" in fused.covers(cpu, torch.float32, 128, 2, 64, "swiglu")
    assert "head_dim" in fused.covers(cpu, torch.float32, 126, 2, 63, "gelu")
    assert "dtype" in fused.covers(cpu, torch.float64, 128, 2, 64, "gelu")
    assert "hidden size" in fused.covers(cpu, torch.bfloat16, 10**6, 2, 64, "gelu")


def test_quack_routes_wait_for_their_host_cost(monkeypatch):
    """A quack op set's routes are consulted by an eager call only from QUACK_EAGER_MIN_TOKENS tokens (below, the
    call is host-bound and quack's launch costs more host time than cuBLAS), and always while capturing or forced."""
    from dataclasses import replace

    from packed_encoders.ops import quack_gemm

    calls = []

    def linear(x, w, b=None):
        calls.append("linear")
        return torch.nn.functional.linear(x, w, b)

    ops = replace(TORCH_OPS, linear=linear, gemm="quack")
    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    batch = _batch(model, [9, 30, 4])
    with torch.no_grad():
        encoder_forward(model, params, batch, ops=ops)
        assert calls == []
        encoder_forward(model, params, batch, ops=ops, rules=plan_mod.Rules(quack_eager_min_tokens=1))
        assert len(calls) == 3 * params.num_hidden_layers
        calls.clear()
        with quack_gemm.forced():
            encoder_forward(model, params, batch, ops=ops)
        assert len(calls) == 3 * params.num_hidden_layers


def test_a_declined_rope_linear_falls_back_to_the_attention_kernel():
    """A layer asks the op set's rope_linear route first; when it declines a call (returns None), a backend that
    fuses RoPE still rotates in the attention kernel rather than in a separate pass."""
    from dataclasses import replace

    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    ops = replace(TORCH_OPS, rope_linear=lambda *args: None)
    attention = {None: Decision("triton"), params.window: Decision("triton")}
    p = plan_mod.plan_for(params, ops, attention, tokens=100, max_seqlen=40, dtype=torch.bfloat16,
                          device=torch.device("cpu"), grad=False)
    assert all(lp.rope_linear and lp.rope_in_attention for lp in p.layers)
    g = plan_mod.plan_for(params, ops, _sdpa(params), tokens=100, max_seqlen=40, dtype=torch.bfloat16,
                          device=torch.device("cpu"), grad=True)
    assert not any(lp.rope_linear or lp.rope_in_attention for lp in g.layers)  # with gradients: neither


def test_quack_glu_route_is_called_on_the_direct_path(fused):
    """With unchecked launches (direct ops) and quack active, the Wi + GLU goes to the op set's own route (quack's
    epilogue), not to the direct op set's small GEMM."""
    from dataclasses import replace

    calls = []

    def glu_linear(x, w, b, act):
        calls.append(x.shape[0])
        return fused.glu(torch.nn.functional.linear(x, w, b), act)

    ops = replace(fused.TRITON_OPS, glu_linear=glu_linear, linear=torch.nn.functional.linear, gemm="quack")
    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    batch = _batch(model, [9, 30, 4])
    with torch.no_grad():
        encoder_forward(model, params, batch, ops=ops, attention_backend="sdpa",
                        rules=plan_mod.Rules(quack_eager_min_tokens=1))
    assert calls == [batch.total_tokens] * params.num_hidden_layers


def test_fa4_skips_its_v_cleaning_after_a_rope_that_cleaned_v(fused):
    """FA4's tiles read past a sequence's end, so it zeroes v's non-finite entries first, unless the plan's RoPE
    did: the in-place Triton RoPE of the unchecked launches and of the training blocks; not the checked ops, the
    torch family, or a layer whose q, k, v may come from a rope_linear epilogue."""
    from dataclasses import replace

    from packed_encoders.attention import flash

    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    fa4 = {None: Decision("fa4"), params.window: Decision("fa4")}

    def fns(ops, grad, rules=None):
        p = plan_mod.plan_for(params, ops, fa4, tokens=100, max_seqlen=40, dtype=torch.bfloat16,
                              device=torch.device("cpu"), grad=grad, rules=rules)
        return {lp.attention for lp in p.layers}

    assert fns(fused.TRITON_OPS, False) == {flash.fa4_varlen_finite_v}  # direct launches
    assert fns(fused.TRITON_OPS, True) == {flash.fa4_varlen_finite_v}  # training blocks
    assert fns(fused.TRITON_OPS, False, plan_mod.Rules(lean=False)) == {flash.fa4_varlen}  # checked ops
    assert fns(fused.TRITON_OPS, True, plan_mod.Rules(blocks=False)) == {flash.fa4_varlen}  # per-op autograd
    assert fns(TORCH_OPS, False) == {flash.fa4_varlen}
    routed = replace(fused.TRITON_OPS, rope_linear=lambda *args: None)
    assert fns(routed, False, plan_mod.Rules(quack_eager_min_tokens=1)) == {flash.fa4_varlen}


def test_training_blocks_call_torch_varlen_without_its_custom_ops(fused):
    """torch varlen's direct entry records aten's own autograd node, so the training blocks call it as the
    unchecked no-grad plan does; the per-op autograd path and the checked ops keep ``varlen_attn``; FA4 has no
    such entry."""
    from packed_encoders.attention import flash

    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    varlen = {None: Decision("varlen"), params.window: Decision("varlen")}

    def fns(grad, rules=None):
        p = plan_mod.plan_for(params, fused.TRITON_OPS, varlen, tokens=100, max_seqlen=40, dtype=torch.bfloat16,
                              device=torch.device("cpu"), grad=grad, rules=rules)
        return {lp.attention for lp in p.layers}

    assert fns(True) == {flash.torch_varlen_direct}  # training blocks
    assert fns(False) == {flash.torch_varlen_direct}  # unchecked no-grad launches
    assert fns(True, plan_mod.Rules(blocks=False)) == {flash.torch_varlen}  # per-op autograd
    assert fns(True, plan_mod.Rules(lean=False)) == {flash.torch_varlen}


def test_pointer_runs_need_every_op_on_a_pointer_kernel(fused):
    """A short no-grad call runs as raw-pointer launches (model/pointers.py) only when every op is one of the
    Triton kernels that take pointers: the Triton GEMMs, the RoPE-fused Triton attention on every layer."""
    from packed_encoders.model import pointers

    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    triton = {None: Decision("triton"), params.window: Decision("triton")}

    def plan(tokens, attention=triton, grad=False, rules=None, ops=fused.TRITON_OPS):
        return plan_mod.plan_for(params, ops, attention, tokens=tokens, max_seqlen=40, dtype=torch.float32,
                                 device=torch.device("cpu"), grad=grad, rules=rules)

    assert plan(100).pointers and pointers.plan_runs_pointers(plan(100))
    assert plan(100).linear_route == "small_gemm" and plan(100).glu == "small_gemm"
    # past the Triton GEMM's size rule: cuBLAS on views of the workspace, Wi + GLU still one Triton GEMM ...
    assert plan(4097).pointers and (plan(4097).linear_route, plan(4097).glu) == ("F.linear", "small_gemm")
    # ... up to Rules.glu_eager_max_tokens, then Wi and the GLU as two launches
    assert plan(8193).pointers and (plan(8193).linear_route, plan(8193).glu) == ("F.linear", "split")
    assert plan(5000, rules=plan_mod.Rules(glu_eager_max_tokens=0)).glu == "split"
    assert plan(5000, grad=True).glu == "split"
    assert plan(16000).pointers
    # Rules.pointer_max_tokens: larger calls are GPU-bound, and the workspace would outgrow the tensor path's peak
    assert not plan(16000, rules=plan_mod.Rules(pointer_max_tokens=15999)).pointers
    assert not plan(100, rules=plan_mod.Rules(pointer_max_tokens=99)).pointers
    assert plan(100, rules=plan_mod.Rules(small_linear_max_tokens=0)).pointers
    varlen = {None: Decision("varlen"), params.window: Decision("triton")}  # FlashAttention-2 after the RoPE kernel
    assert plan(100, attention=varlen).pointers and plan(5000, attention=varlen).pointers
    assert not plan(100, attention=_sdpa(params)).pointers
    assert not plan(100, attention={None: Decision("triton"), params.window: Decision("sdpa")}).pointers
    assert not plan(100, grad=True).pointers and not plan(100, ops=TORCH_OPS).pointers
    assert not plan(100, rules=plan_mod.Rules(fused_rope=False)).pointers  # the Triton kernel's RoPE as its own op
    # on CPU the run declines (CUDA pointers only) and the tensor path gives the result
    batch = _batch(model, [9, 30, 4])
    with torch.no_grad():
        got = encoder_forward(model, params, batch, attention=triton, ops=fused.TRITON_OPS)
        ref = encoder_forward(model, params, batch, attention=triton, ops=fused.TRITON_OPS,
                              rules=plan_mod.Rules(small_linear_max_tokens=0))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_pointer_workspace_buffers_are_aligned_and_disjoint():
    from packed_encoders.model import workspace
    from packed_encoders.model.pointers import _ALIGN, _layout, _widths
    from packed_encoders.ops import cublaslt

    hidden, inner, size = 96, 160, 2
    for pre in (False, True):
        widths = _widths(hidden, inner, pre)
        assert len(widths) == 6 + pre
        for lt in (False, True):
            for tokens in (1, 37, 64):
                nbytes, offs, lt_at = _layout(tokens, widths, size, lt)
                assert all(o % _ALIGN == 0 and o >= 0 for o in offs)
                ends = [o + tokens * w * size for o, w in zip(offs, widths)]
                assert all(e <= o for e, o in zip(ends, offs[1:]))
                assert (lt_at is not None) == lt
                last = ends[-1] if lt_at is None else lt_at + cublaslt.WORKSPACE_BYTES
                assert lt_at is None or (lt_at % _ALIGN == 0 and lt_at >= ends[-1])
                assert last <= nbytes  # what _run allocates, from an aligned base
                for base in (0, 16, 4096 + 48):  # workspace.empty's buffer holds nbytes from its aligned base
                    aligned = -(-base // workspace.ALIGN) * workspace.ALIGN
                    assert aligned % _ALIGN == 0 and aligned + nbytes <= base + workspace.size_class(nbytes + _ALIGN)


def test_first_pointer_run_of_a_launch_class_is_checked(monkeypatch):
    """Raw-pointer runs are checked as CUDA graphs are: the first run of a launch class against the tensor path,
    bit for bit (the tensor path's result returned); a mismatch turns them off for the process, with a warning
    and the reason in describe()."""
    from packed_encoders.model import pointers

    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    batch = _batch(model, [9, 30, 4])
    y = torch.randn(batch.total_tokens, params.hidden_size)
    plan = SimpleNamespace(linear_route="small_gemm", glu="small_gemm", layers=())
    monkeypatch.setattr(pointers, "_run", lambda *a: y.clone())
    monkeypatch.setattr(pointers, "_VERIFIED", set())
    monkeypatch.setattr(pointers, "_STATE", {"off": None})
    calls = []

    def tensor_path(result):
        def run():
            calls.append(1)
            assert pointers._LOCAL.declined  # no raw-pointer run inside the check
            return result
        return run

    got = pointers.run(model, params, batch, plan, None, tensor_path(y.clone()))
    assert torch.equal(got, y) and len(calls) == 1 and pointers.off_reason() is None
    pointers.run(model, params, batch, plan, None, tensor_path(y.clone()))
    assert len(calls) == 1  # that launch class is checked: no second tensor run
    longer = _batch(model, [9, 30, 4, 300])  # another size class: checked again, and it disagrees
    y = torch.randn(longer.total_tokens, params.hidden_size)
    ref = y + 1
    with pytest.warns(RuntimeWarning, match="disagreed with the tensor path"):
        got = pointers.run(model, params, longer, plan, None, tensor_path(ref))
    assert torch.equal(got, ref) and "disagreed" in pointers.off_reason()
    assert pointers.run(model, params, batch, plan, None, tensor_path(y)) is None  # off for the process
    assert not pointers._LOCAL.declined


def test_pointer_check_tolerates_cublaslt_rounding_not_wrong_rows():
    """With cuBLASLt projections the first run's check allows another summation order (every row's cosine >= 0.999),
    not a row of other values or a non-finite entry the tensor path does not have; without them, bit for bit."""
    from packed_encoders.model.pointers import _agrees

    torch.manual_seed(0)
    ref = torch.randn(64, 96).bfloat16()
    near = (ref.float() * (1 + 4e-3 * torch.randn(64, 96))).bfloat16()
    assert _agrees(ref.clone(), ref, exact=True) and _agrees(ref.clone(), ref, exact=False)
    assert _agrees(near, ref, exact=False) and not _agrees(near, ref, exact=True)
    swapped = near.clone()
    swapped[[3, 40]] = near[[40, 3]]  # a wrong row offset
    assert not _agrees(swapped, ref, exact=False)
    nan = near.clone()
    nan[5, 7] = float("nan")
    assert not _agrees(nan, ref, exact=False)
    both = ref.clone()
    both[5, 7] = float("inf")
    assert _agrees(both.clone(), both, exact=False)


def test_workspace_size_classes_cover_the_request_within_a_quarter():
    """Raw-pointer buffers are sized in four classes per power of two (model/workspace.py): never smaller than the
    request, at most 25 % larger, one size for nearby token counts (so a later step reuses the cached blocks)."""
    from packed_encoders.model import workspace

    for n in (1, 4096, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 * (1 << 24) + 5, 204 * 2**20, 214 * 2**20):
        c = workspace.size_class(n)
        assert n <= c <= max(n, n * 1.25), (n, c)
        assert workspace.size_class(c) == c
    assert workspace.size_class(1000) == 1000  # small: the caching allocator's own rounding
    assert workspace.size_class(204 * 2**20) == workspace.size_class(214 * 2**20)  # the two sets one run held
    classes = {workspace.size_class(n) for n in range((1 << 24) + 1, (1 << 25) + 1, 4099)}
    assert len(classes) == 4
    arena = workspace.Arena()
    assert (arena.add(3), arena.add(300), arena.add(0), arena.size) == (0, 256, 768, 768)


# ------------------------------------------------------------------------------------------------ called slots


def _lora(model, targets, seed: int = 1, **kw):
    """``model`` with peft LoRA layers on ``targets`` (r=4), ``lora_B`` random (peft initialises it to zero)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, **kw), model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def test_called_slots_turn_off_the_routes_that_read_their_weights(fused):
    """A projection slot whose module the forward calls (model/calls.py) takes no route that reads its weight:
    no RoPE epilogue on its Wqkv (the other layers keep theirs), no unchecked launches or raw pointers, no training
    blocks or stack; a plain encoder's plan is the one it had without the argument."""
    from dataclasses import replace

    from packed_encoders.model.calls import PLAIN, ModuleCalls

    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    triton = {None: Decision("triton"), params.window: Decision("triton")}
    calls = ModuleCalls(((True, False, False, False), (False, False, True, False), PLAIN, PLAIN),
                        ("layers.0.attn.Wqkv (X)", "layers.1.mlp.Wi (X)"))

    def plan(calls=None, grad=False, ops=fused.TRITON_OPS, rules=None, **kw):
        return plan_mod.plan_for(params, ops, triton, tokens=100, max_seqlen=40, dtype=torch.float32,
                                 device=torch.device("cpu"), grad=grad, rules=rules, calls=calls, **kw)

    plain = plan()
    assert plain is plan_mod.plan_for(params, fused.TRITON_OPS, triton, tokens=100, max_seqlen=40,
                                      dtype=torch.float32, device=torch.device("cpu"), grad=False)
    assert plain.direct and plain.pointers and (plain.linear_route, plain.glu) == ("small_gemm", "small_gemm")
    assert plain.calls is None and all(lp.calls == PLAIN for lp in plain.layers)
    p = plan(calls)
    assert not p.direct and not p.pointers and p.ops is fused.TRITON_OPS and p.calls is calls
    assert p.why_checked.startswith("module call at layers.0.attn.Wqkv (X) and 1 more slot: ")
    assert [lp.calls for lp in p.layers] == list(calls.layers)
    routed = replace(fused.TRITON_OPS, rope_linear=lambda *args: None)  # an op set with a RoPE epilogue
    assert all(lp.rope_linear for lp in plan(ops=routed).layers)
    assert [lp.rope_linear for lp in plan(calls, ops=routed).layers] == [False, True, True, True]
    blocks = plan_mod.Rules(blocks=True)
    g_plain = plan(grad=True, rules=blocks, stack_off=None)
    assert g_plain.kernels is not None and g_plain.stack
    g = plan(calls, grad=True, rules=blocks, stack_off=None)
    assert g.kernels is None and not g.stack
    assert g.stack_off == "one autograd node per op: module call at layers.0.attn.Wqkv (X) and 1 more slot"


@pytest.mark.parametrize("dora", [False, True], ids=["lora_merged", "dora_called"])
def test_called_slots_never_reach_a_weight_reading_route(dora):
    """With every weight-reading route an op set has consulted (quack forced: the projections, the Wi + GLU epilogue
    and the RoPE epilogue), the plain slots' weights reach them and no called slot's base weight does: a LoRA
    layer's merged weight does (a new tensor), a DoRA layer is called; the output is stock's, adapters included."""
    from dataclasses import replace

    from torch.nn import functional as F

    from packed_encoders.ops import geglu_torch, quack_gemm
    from tests.helpers import stock, stock_positions

    model = _lora(make_model("base_like"), ["layers.0.attn.Wqkv", "layers.1.mlp.Wi", "layers.2.attn.Wo",
                                            "layers.3.mlp.Wo"], use_dora=dora)
    params = ModernBertParams.from_hf_config(model.config)
    seen = []

    def linear(x, w, b=None):
        seen.append(w)
        return F.linear(x, w, b)

    def glu_linear(x, w, b, activation):
        seen.append(w)
        return geglu_torch(F.linear(x, w, b), activation)

    def rope_linear(x, w, b, positions, freq, nh, hd):
        seen.append(w)
        return None  # declined: the forward projects with `linear`, then rotates

    ops = replace(TORCH_OPS, linear=linear, glu_linear=glu_linear, rope_linear=rope_linear, gemm="quack")
    ids, mask = padded_batch([9, 30, 4], side="mixed")
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=model.config.vocab_size)
    with torch.no_grad(), quack_gemm.forced():
        out = batch.pad(encoder_forward(model, params, batch, ops=ops))
        ref = stock(model, input_ids=ids, attention_mask=mask, position_ids=stock_positions(mask)).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=2e-5, rtol=1e-4)
    slots = [getattr(getattr(layer, parent), name) for layer in model.layers
             for parent, name in (("attn", "Wqkv"), ("attn", "Wo"), ("mlp", "Wi"), ("mlp", "Wo"))]
    called = [m for m in slots if type(m) is not torch.nn.Linear]
    assert len(called) == 4
    plain = {id(m.weight) for m in slots if m not in called}
    assert plain <= {id(w) for w in seen} and not {id(w) for w in seen} & {id(m.base_layer.weight) for m in called}
    assert len({id(w) for w in seen} - plain) == (0 if dora else 4)  # (the merged weights)


@pytest.mark.parametrize("grad", [False, True])
def test_fused_kernels_around_lora_layers_match_stock(fused, grad):
    """The Triton op set (interpreted) around called LoRA layers: without gradient the checked ops instead of the
    unchecked launches, with gradients one autograd node per op instead of the training blocks (asked for with
    ``Rules(blocks=True)``); the output and every LoRA gradient are stock's."""
    from tests.helpers import stock, stock_positions

    model = _lora(make_model("base_like"), ["Wqkv", "Wo", "Wi"])
    params = ModernBertParams.from_hf_config(model.config)
    batch = _batch(model, [9, 30, 4])
    ids, mask = padded_batch([9, 30, 4], side="mixed")
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    with torch.set_grad_enabled(grad):
        out = batch.pad(encoder_forward(model, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa",
                                        rules=plan_mod.Rules(lean=True, blocks=True)))
        ref = stock(model, input_ids=ids, attention_mask=mask, position_ids=stock_positions(mask)).last_hidden_state
    plan = plan_mod.last_plan()
    if grad:
        assert plan.calls is not None and not plan.direct and plan.kernels is None and not plan.pointers
    else:  # LoRA layers as merged weights: the unchecked launches, no raw pointers (they read the modules)
        assert plan.calls is None and plan.merged == 4 * len(model.layers) and not plan.pointers
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=2e-5, rtol=1e-4)
    if grad:
        got = torch.autograd.grad(out[real].square().mean(), lora)
        want = torch.autograd.grad(ref[real].square().mean(), lora)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-3)
