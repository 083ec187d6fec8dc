"""Training forwards with one autograd node per layer block (model/blocks.py) or for the whole encoder stack
(model/stack.py) and the cached autocast weight casts (ops/weight_cast.py): gradients against the per-op path and
stock HF, dropout, checkpointing, autocast, retained graphs, staleness."""

from __future__ import annotations

import pytest
import torch

from packed_encoders.attention.sdpa import sdpa_varlen
from packed_encoders.batch import unpad
from packed_encoders.model import plan as plan_mod
from packed_encoders.model.forward import encoder_forward
from packed_encoders.model.params import ModernBertParams
from packed_encoders.ops import TORCH_OPS, weight_cast
from tests.conftest import make_model, padded_batch, stock, stock_positions

LEAN, PER_OP = plan_mod.Rules(lean=True, blocks=True), plan_mod.Rules(lean=False)
BLOCKS = plan_mod.Rules(lean=True, blocks=True, stack=False)  # one node per block, never the stack


def _setup(name="odd", lengths=(9, 30, 4), **overrides):
    model = make_model(name, **overrides)
    params = ModernBertParams.from_hf_config(model.config)
    ids, mask = padded_batch(list(lengths), side="mixed")
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=model.config.vocab_size)
    return model, params, batch, ids, mask


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    out = fn()
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _nodes(out):
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return len(seen)


@pytest.mark.parametrize("name", ["odd", "base_like"])
def test_blocks_match_the_per_op_path_fp32(name):
    model, params, batch, _, _ = _setup(name)
    model.train()
    out_l, g_l = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN))
    out_p, g_p = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa", rules=PER_OP))
    torch.testing.assert_close(out_l, out_p, atol=1e-5, rtol=1e-5)
    assert set(g_l) == set(g_p)
    for n in g_p:
        torch.testing.assert_close(g_l[n], g_p[n], atol=1e-5, rtol=1e-4, msg=n)
    # the point of the blocks: far fewer autograd nodes (each costs host time in forward and backward)
    with torch.enable_grad():
        lean_nodes = _nodes(encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN))
        per_op_nodes = _nodes(encoder_forward(model, params, batch, attention_backend="sdpa", rules=PER_OP))
    attn = _attention_nodes(params, batch)  # the same backend calls in both paths
    assert (lean_nodes - attn) * 2 < per_op_nodes - attn, (lean_nodes, per_op_nodes, attn)


def _attention_nodes(params, batch):
    """Autograd nodes the sdpa backend adds to one forward (the blocks replace the nodes around it)."""
    total = 0
    for layer in range(params.num_hidden_layers):
        window = params.layer_window(layer)
        if window is not None and window >= batch.max_seqlen - 1:
            window = None  # as plan_attention
        q, k, v = (torch.randn(batch.total_tokens, params.num_attention_heads, params.head_dim, requires_grad=True)
                   for _ in range(3))
        total += _nodes(sdpa_varlen(q, k, v, batch.cu_seqlens, batch.max_seqlen, window=window, scale=1.0)) - 3
    return total


def test_blocks_under_cpu_autocast_match_stock_gradients():
    """bf16 autocast on fp32 masters: output and per-parameter gradient cosine against stock HF under the same
    autocast, and the gradients land on the fp32 parameters in fp32."""
    model, params, batch, ids, mask = _setup("base_like", lengths=(40, 64, 17))
    model.train()
    real = mask.bool()
    target = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(3))

    def loss(out):
        return ((out.float() - target)[real] ** 2).mean()

    def run(fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn()
        loss(out).backward()
        return out.detach().float(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                      if p.grad is not None}

    ref_out, ref = run(lambda: stock(model, input_ids=ids, attention_mask=mask,
                                     position_ids=stock_positions(mask)).last_hidden_state)
    got_out, got = run(lambda: batch.pad(encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN)))
    assert _cos(got_out[real], ref_out[real]) > 0.999
    assert set(got) == set(ref)
    for n in ref:
        assert got[n].dtype == torch.float32
        assert _cos(got[n], ref[n]) > 0.99, n


def test_blocks_dropout_and_checkpointing():
    """Dropout in every slot (embedding, attention output, MLP; attention probabilities on sdpa): the masks drawn in
    forward are the ones the backward applies, and gradient checkpointing replays them (same gradients)."""
    model, params, batch, _, _ = _setup("base_like", embedding_dropout=0.1, mlp_dropout=0.2, attention_dropout=0.1)
    model.train()

    def run(ckpt):
        torch.manual_seed(11)
        return _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa",
                                                     gradient_checkpointing=ckpt, rules=LEAN))

    out_a, g_a = run(False)
    out_b, g_b = run(True)
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
    for n in g_a:
        torch.testing.assert_close(g_a[n], g_b[n], atol=1e-6, rtol=1e-5, msg=n)
    torch.manual_seed(12)
    out_c, _ = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN))
    assert (out_c - out_a).abs().max() > 1e-3  # another seed, other masks
    # the same masks through the per-op path give the same gradients (dropout's RNG draws match)
    torch.manual_seed(11)
    out_p, g_p = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa", rules=PER_OP))
    torch.testing.assert_close(out_a, out_p, atol=1e-5, rtol=1e-5)
    for n in g_a:
        torch.testing.assert_close(g_a[n], g_p[n], atol=1e-5, rtol=1e-4, msg=n)


def test_blocks_dropout_rate_one_matches_the_per_op_path():
    """Dropout rate 1 (every element dropped): the blocks' backward scales by 0, as torch's own dropout does,
    rather than dividing by 1 - p."""
    model, params, batch, _, _ = _setup("base_like", mlp_dropout=1.0, attention_dropout=1.0)
    model.train()
    results = []
    for rules in (LEAN, PER_OP):
        torch.manual_seed(13)
        results.append(_grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa",
                                                             rules=rules)))
    (out_l, g_l), (out_p, g_p) = results
    torch.testing.assert_close(out_l, out_p, atol=1e-5, rtol=1e-5)
    for n in g_p:
        assert torch.isfinite(g_l[n]).all(), n
        torch.testing.assert_close(g_l[n], g_p[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("name", ["odd", "base_like"])
@pytest.mark.parametrize("autocast", [False, True])
def test_stack_matches_the_per_block_path(name, autocast):
    """The stack runs the blocks' functions: outputs equal, gradients equal to rounding (fp32, and bf16 autocast on
    fp32 masters); one autograd node for every layer; describe()'s plan facts say which ran."""
    model, params, batch, _, _ = _setup(name)
    model.train()

    def run(rules):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa",
                                                         rules=rules))

    out_s, g_s = run(LEAN)
    assert plan_mod.last_plan().stack and plan_mod.last_plan().stack_off is None
    out_b, g_b = run(BLOCKS)
    assert not plan_mod.last_plan().stack and plan_mod.last_plan().kernels is not None
    assert plan_mod.last_plan().stack_off.startswith("Rules.stack is off")
    torch.testing.assert_close(out_s, out_b, atol=0, rtol=0)
    assert set(g_s) == set(g_b) and len(g_s) == len(list(model.parameters()))
    for n in g_b:
        assert g_s[n].dtype == torch.float32
        torch.testing.assert_close(g_s[n], g_b[n], atol=1e-6, rtol=1e-5, msg=n)
    with torch.enable_grad():
        stack_nodes = _nodes(encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN))
        block_nodes = _nodes(encoder_forward(model, params, batch, attention_backend="sdpa", rules=BLOCKS))
    # the blocks' nodes (two per layer plus the attention's) become one; embeddings and final norm stay
    assert stack_nodes + 2 * params.num_hidden_layers <= block_nodes, (stack_nodes, block_nodes)
    assert stack_nodes < 20 + len(list(model.parameters())), stack_nodes  # leaves, embedding, norms, the stack


def test_stack_on_cpu_says_why_it_is_not_on_raw_pointers():
    """The raw-pointer stack (model/stack_pointers.py) is CUDA only: a CPU call runs the tensor form and says why
    (``last_pointers_off``, and describe()'s eager_plan through a packed model); cuBLASLt says it has no device."""
    from packed_encoders.model.stack import last_pointers_off
    from packed_encoders.ops import cublaslt

    model, params, batch, _, _ = _setup("base_like")
    model.train()
    encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN).sum().backward()
    assert plan_mod.last_plan().stack
    assert last_pointers_off().startswith("not a CUDA call"), last_pointers_off()
    if not torch.cuda.is_available():
        assert cublaslt.status() == "no CUDA device"


def test_stack_retained_graph_in_place_change_and_second_backward():
    """``retain_graph=True`` keeps the stack's activations for another backward (gradients accumulate to twice);
    without it a second backward raises, as does a weight changed in place between forward and backward."""
    model, params, batch, _, _ = _setup("base_like")
    model.train()

    def fwd():
        return encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN)

    model.zero_grad(set_to_none=True)
    loss = fwd().square().mean()
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], atol=1e-6, rtol=1e-5, msg=n)
    with pytest.raises(RuntimeError, match="second time|freed"):
        loss.backward()
    loss = fwd().square().mean()
    with torch.no_grad():
        model.layers[1].mlp.Wi.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # second derivatives: the raw kernels have none, so differentiating the gradients raises (both granularities)
    for rules in (LEAN, BLOCKS):
        out = encoder_forward(model, params, batch, attention_backend="sdpa", rules=rules)
        w = model.layers[1].mlp.Wo.weight
        (g,) = torch.autograd.grad(out.square().mean(), w, create_graph=True)
        with pytest.raises(RuntimeError, match=r"packed_encoders: second derivatives.*pe\.unpack"):
            g.sum().backward()


def test_stack_runs_query_only_tails():
    """A query-only batch (ColBERT query expansion: trailing masked positions computed, ``key_lens``) trains as one
    stack node, its attention given the ``key_lens``: the outputs and gradients of one node per block."""
    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    ids, mask = padded_batch([9, 30, 4], side="right")
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=model.config.vocab_size, trailing_query_only=True)
    assert batch.key_lens is not None and int(batch.key_lens.sum()) < batch.total_tokens
    model.train()
    out_b, g_b = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa", rules=BLOCKS))
    assert not plan_mod.last_plan().stack
    out_s, g_s = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN))
    assert plan_mod.last_plan().stack, plan_mod.last_plan().stack_off
    torch.testing.assert_close(out_s, out_b, atol=0, rtol=0)
    assert g_s.keys() == g_b.keys()
    for n in g_b:
        torch.testing.assert_close(g_s[n], g_b[n], atol=1e-6, rtol=1e-5, msg=n)
    # the tails are queries only: no real token's output depends on them
    ids2 = ids.clone()
    ids2[~mask.bool()] = (ids2[~mask.bool()] + 1) % model.config.vocab_size
    batch2 = unpad(input_ids=ids2, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                   vocab_size=model.config.vocab_size, trailing_query_only=True)
    with torch.enable_grad():
        out2 = encoder_forward(model, params, batch2, attention_backend="sdpa", rules=LEAN)
    real = torch.cat([torch.arange(int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i]) + int(batch.key_lens[i]))
                      for i in range(batch.num_seqs)])
    torch.testing.assert_close(out2.detach()[real], out_s[real], atol=0, rtol=0)


def test_stack_steps_aside_where_the_call_needs_layers():
    """Gradient checkpointing and hidden states run one node per block (with the same
    gradients), as does a training graph's capture; without gradients nothing changes."""
    from packed_encoders.model.stack import stack_problem

    model, params, batch, _, _ = _setup("base_like")
    model.train()
    assert stack_problem(False, False) is None
    assert "checkpointing" in stack_problem(True, False)
    assert "hidden_states" in stack_problem(False, True)
    out_s, g_s = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN))
    out_c, g_c = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN,
                                                       gradient_checkpointing=True))
    assert not plan_mod.last_plan().stack and "checkpointing" in plan_mod.last_plan().stack_off
    torch.testing.assert_close(out_s, out_c, atol=0, rtol=0)
    for n in g_s:
        torch.testing.assert_close(g_s[n], g_c[n], atol=1e-6, rtol=1e-5, msg=n)
    with torch.autograd.graph.save_on_cpu():  # offloading sees what the per-block nodes save
        assert "saved-tensor hooks" in stack_problem(False, False)
        out_o, g_o = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa",
                                                           rules=LEAN))
        assert not plan_mod.last_plan().stack and "saved-tensor hooks" in plan_mod.last_plan().stack_off
    torch.testing.assert_close(out_s, out_o, atol=0, rtol=0)
    hidden: list = []
    with torch.enable_grad():
        encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN, hidden_states=hidden)
    assert not plan_mod.last_plan().stack and len(hidden) == params.num_hidden_layers + 1
    with torch.no_grad():
        encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN)
    assert not plan_mod.last_plan().stack and plan_mod.last_plan().kernels is None
    assert plan_mod.last_plan().stack_off is None  # nothing to stack without gradients
    with torch.enable_grad():  # the plain-PyTorch op set trains through autograd's own per-op nodes
        encoder_forward(model, params, batch, attention_backend="sdpa")
    assert not plan_mod.last_plan().stack and "one autograd node per op" in plan_mod.last_plan().stack_off
    assert "checkpointing" not in plan_mod.last_plan().stack_off
    with torch.enable_grad():  # the call's own reason is named there too
        encoder_forward(model, params, batch, attention_backend="sdpa", gradient_checkpointing=True)
    assert "one autograd node per op" in plan_mod.last_plan().stack_off
    assert "checkpointing" in plan_mod.last_plan().stack_off


def test_frozen_parameters_get_no_gradient():
    model, params, batch, _, _ = _setup("base_like")
    model.train()
    model.layers[1].mlp.Wi.weight.requires_grad_(False)
    model.layers[0].attn.Wqkv.weight.requires_grad_(False)
    _, g = _grads(model, lambda: encoder_forward(model, params, batch, attention_backend="sdpa", rules=LEAN))
    assert "layers.1.mlp.Wi.weight" not in g and "layers.0.attn.Wqkv.weight" not in g
    assert "layers.1.mlp.Wo.weight" in g and "embeddings.tok_embeddings.weight" in g


# ------------------------------------------------------------------------------------------ cached weight casts


def test_weight_cast_is_reused_and_never_stale():
    w = torch.nn.Parameter(torch.randn(8, 4))
    a = weight_cast.cast(w, torch.bfloat16)
    assert a.dtype == torch.bfloat16 and weight_cast.cast(w, torch.bfloat16) is a  # reused
    assert weight_cast.cast(w, torch.float32) is w  # already that dtype
    with torch.no_grad():
        w.add_(1.0)  # in place: version bump
    b = weight_cast.cast(w, torch.bfloat16)
    assert b is not a and torch.equal(b, w.detach().to(torch.bfloat16))
    w.data = torch.randn(8, 4)  # a new storage
    c = weight_cast.cast(w, torch.bfloat16)
    assert torch.equal(c, w.detach().to(torch.bfloat16))
    w.grad = torch.ones_like(w)
    torch.optim.AdamW([w], lr=0.1, fused=True).step()  # fused: no version bump; the step hook invalidates
    d = weight_cast.cast(w, torch.bfloat16)
    assert torch.equal(d, w.detach().to(torch.bfloat16))
    with torch.no_grad():
        w.data.mul_(2.0)  # through .data: not seen ...
    assert weight_cast.cast(w, torch.bfloat16) is d
    weight_cast.clear()  # ... until cleared
    assert torch.equal(weight_cast.cast(w, torch.bfloat16), w.detach().to(torch.bfloat16))
    weight_cast.clear()
    with torch.inference_mode():  # cached under inference_mode, then saved for a backward: a normal tensor
        e = weight_cast.cast(w, torch.bfloat16)
    assert not e.is_inference() and weight_cast.cast(w, torch.bfloat16) is e


def test_cast_group_is_reused_never_stale_and_keeps_old_copies():
    ws = tuple(torch.nn.Parameter(torch.randn(3 + i, 4)) for i in range(3))
    a = weight_cast.cast_group(ws, torch.bfloat16)
    assert weight_cast.cast_group(ws, torch.bfloat16) is a  # one lookup for the group
    assert all(c.dtype == torch.bfloat16 and torch.equal(c, w.detach().to(torch.bfloat16)) for c, w in zip(a, ws))
    assert weight_cast.cast_group(ws, None) is ws
    kept = a[1].clone()
    with torch.no_grad():
        ws[1].mul_(2.0)  # one weight changed in place: the whole group is cast again, into new memory
    b = weight_cast.cast_group(ws, torch.bfloat16)
    assert b is not a and torch.equal(b[1], ws[1].detach().to(torch.bfloat16))
    assert torch.equal(a[1], kept)  # a copy handed out before (a pending backward may read it) is untouched
    for w in ws:
        w.grad = torch.ones_like(w)
    torch.optim.AdamW(ws, lr=0.1, fused=True).step()  # no version bump: the optimizer-step hook
    c = weight_cast.cast_group(ws, torch.bfloat16)
    assert c is not b and all(torch.equal(x, w.detach().to(torch.bfloat16)) for x, w in zip(c, ws))
    mixed = (ws[0], torch.randn(2, 2, dtype=torch.bfloat16))  # one already in the dtype: cast one by one
    got = weight_cast.cast_group(mixed, torch.bfloat16)
    assert got[1] is mixed[1] and torch.equal(got[0], ws[0].detach().to(torch.bfloat16))


def test_cached_casts_leave_parameters_swappable_and_go_with_their_storage():
    """The cache holds no weak reference to a parameter (``torch.utils.swap_tensors`` refuses a tensor that has
    one, so after one autocast call ``module.to()`` / ``load_state_dict`` failed under
    ``set_swap_module_params_on_conversion(True)``); a swapped parameter is cast again, and an entry goes with
    its parameter's storage."""
    import gc
    import weakref

    w = torch.nn.Parameter(torch.randn(5, 4))
    ws = tuple(torch.nn.Parameter(torch.randn(3, 4)) for _ in range(2))
    a = weight_cast.cast(w, torch.bfloat16)
    assert weight_cast.cast(w, torch.bfloat16) is a
    group = weight_cast.cast_group(ws, torch.bfloat16)
    assert not weakref.getweakrefs(w) and not any(weakref.getweakrefs(t) for t in ws)
    other = torch.nn.Parameter(torch.randn(5, 4))
    torch.utils.swap_tensors(w, other)  # w now holds other's storage
    assert torch.equal(weight_cast.cast(w, torch.bfloat16), w.detach().to(torch.bfloat16))
    torch.utils.swap_tensors(ws[1], torch.nn.Parameter(torch.zeros(3, 4)))
    again = weight_cast.cast_group(ws, torch.bfloat16)
    assert again is not group and not again[1].any()
    before = len(weight_cast._CACHE), len(weight_cast._GROUPS)
    del w, other, ws, again, group, a
    gc.collect()
    assert len(weight_cast._CACHE) < before[0] and len(weight_cast._GROUPS) < before[1]


def test_in_a_process_group_casts_are_made_per_call():
    """FSDP2 all-gathers new values into the same parameter at the same address under
    ``_unsafe_preserve_version_counter`` (weights loaded or edited through their shards): nothing the cache reads
    moves, so in a process group every cast is made afresh (a stale copy was served under FSDP2 + autocast)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch without distributed support")
    w = torch.nn.Parameter(torch.randn(5, 4))
    ws = (w, torch.nn.Parameter(torch.randn(3, 4)))
    copies = weight_cast.StaticCopies(ws, torch.bfloat16)

    def gather_in_place(value):  # what FSDP2's all-gather copy-out does to the unsharded parameter
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
            w.copy_(value)

    def fresh(t):
        return t.detach().to(torch.bfloat16)

    weight_cast.cast(w, torch.bfloat16)  # cached, as are the group's copies and the static ones
    weight_cast.cast_group(ws, torch.bfloat16)
    copies.refresh()
    gather_in_place(torch.randn(5, 4))
    assert not torch.equal(weight_cast.cast(w, torch.bfloat16), fresh(w))  # outside a group: not seen (cached)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(2):
            gather_in_place(torch.randn(5, 4))
            assert torch.equal(weight_cast.cast(w, torch.bfloat16), fresh(w))
            assert torch.equal(weight_cast.cast_group(ws, torch.bfloat16)[0], fresh(w))
            epoch = copies.epoch
            assert copies.refresh() == epoch and torch.equal(copies.copies[0], fresh(w))
    finally:
        dist.destroy_process_group()
    weight_cast.clear()


def test_packed_model_moves_and_loads_by_swapping_after_an_autocast_call():
    import copy

    import packed_encoders as pe

    model = make_model("base_like").eval()
    reference = copy.deepcopy(model)
    pe.pack(model)
    ids, mask = padded_batch([7, 12], side="right")
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            first = model(input_ids=ids, attention_mask=mask).last_hidden_state
        model.to(torch.float64).to(torch.float32)
        state = {k: v * 0.5 if v.is_floating_point() else v for k, v in reference.state_dict().items()}
        model.load_state_dict(state)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            second = model(input_ids=ids, attention_mask=mask).last_hidden_state
            reference.load_state_dict(state)
            expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    real = mask.bool()
    assert (second[real].float() - first[real].float()).abs().max() > 1e-2  # the loaded weights are read
    cos = torch.nn.functional.cosine_similarity(second[real].float(), expected[real].float(), dim=-1)
    assert cos.min() > 0.99


def test_static_copies_are_served_in_place_and_refreshed_only_after_a_change():
    w = torch.nn.Parameter(torch.randn(8, 4))
    b = torch.nn.Parameter(torch.randn(8))
    copies = weight_cast.StaticCopies([w, b], torch.bfloat16)
    addresses = [c.data_ptr() for c in copies.copies]
    assert copies.refresh() == 1 and copies.refresh() == 1  # nothing changed: no second cast
    assert torch.equal(copies.copies[0], w.detach().to(torch.bfloat16))
    with copies.serving():
        assert weight_cast.cast(w, torch.bfloat16) is copies.copies[0]
        assert weight_cast.cast(w.detach(), torch.bfloat16) is copies.copies[0]  # an alias: same address
        assert weight_cast.cast(w, torch.float16) is not copies.copies[0]  # another dtype: a cast
    assert weight_cast.cast(w, torch.bfloat16) is not copies.copies[0]  # outside the block: the cache
    with torch.no_grad():
        w.mul_(2.0)  # version bump
    assert copies.refresh() == 2 and torch.equal(copies.copies[0], w.detach().to(torch.bfloat16))
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    torch.optim.AdamW([w, b], lr=0.1, fused=True).step()  # no version bump: the optimizer-step hook
    assert copies.refresh() == 3 and torch.equal(copies.copies[1], b.detach().to(torch.bfloat16))
    assert [c.data_ptr() for c in copies.copies] == addresses  # refreshed in place (a graph reads them)
    assert copies.nbytes() == (32 + 8) * 2
    weight_cast.expire()  # the encoder trained; a hand-written update through .data follows (no version bump)
    w.data.add_(1.0)
    # cast again, the epoch kept (a pending training graph's backward reads copies of unchanged weights)
    assert copies.refresh() == 3 and torch.equal(copies.copies[0], w.detach().to(torch.bfloat16))
    w.data.add_(1.0)  # no training step, no optimizer step since: not seen (weight_cast.clear() makes it seen)
    assert copies.refresh() == 3 and not torch.equal(copies.copies[0], w.detach().to(torch.bfloat16))
    weight_cast.clear()
    assert copies.refresh() == 4 and torch.equal(copies.copies[0], w.detach().to(torch.bfloat16))


@pytest.mark.parametrize("grad", [False, True])
def test_autocast_forward_sees_in_place_weight_changes(grad):
    """Two forwards under autocast with a weight changed in place between them: the second sees the change
    (no-grad: the cached cast is invalidated; grad: the blocks read it the same way), and with gradients the fp32
    master receives them."""
    model, params, batch, _, _ = _setup("base_like")
    model.train(grad)
    w = model.layers[2].mlp.Wo.weight

    def fwd():
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            return encoder_forward(model, params, batch, attention_backend="sdpa", ops=TORCH_OPS, rules=LEAN)

    first = fwd()
    again = fwd()
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    with torch.no_grad():
        w.mul_(3.0)
    second = fwd()
    assert (second.float() - first.float()).abs().max() > 1e-2
    if grad:
        model.zero_grad(set_to_none=True)
        second.float().square().mean().backward()
        assert w.grad is not None and w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        third = fwd()
        assert (third.float() - second.float()).abs().max() > 1e-2


@pytest.mark.parametrize("rules", [LEAN, BLOCKS, PER_OP], ids=["stack", "blocks", "per_op"])
def test_autocast_forwards_see_data_updates_after_a_training_step(rules):
    """A hand-written update through ``.data`` after a training step (``p.data.add_(...)``: no version bump, no
    optimizer step) is read by the next forward under autocast, with and without gradients, as stock HF's casts
    read it; the cached bf16 copies were once handed out again, stale, and the loop trained and evaluated on the
    old weights."""
    model, params, batch, _, _ = _setup("base_like")
    model.train()

    def fwd(grad):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            return encoder_forward(model, params, batch, attention_backend="sdpa", ops=TORCH_OPS, rules=rules)

    first = fwd(False)  # an evaluation call: its copies are cached
    fwd(True).float().square().mean().backward()
    for p in model.parameters():  # manual SGD through .data
        p.data.add_(p.grad, alpha=-0.5)
        p.grad = None
    second, second_grad = fwd(False), fwd(True)
    weight_cast.clear()
    fresh, fresh_grad = fwd(False), fwd(True)
    assert (fresh.float() - first.float()).abs().max() > 1e-2  # the update matters
    torch.testing.assert_close(second, fresh, atol=0, rtol=0)
    torch.testing.assert_close(second_grad, fresh_grad, atol=0, rtol=0)
