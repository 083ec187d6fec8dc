"""Training CUDA graphs: the packed encoder's forward and backward for one bucket, captured as two graphs.

A training step of the packed encoder is host-bound: ~110 kernels forward and ~200 backward, each launched from
Python. :class:`TrainRunner` captures both passes for one bucket (``tokens``, ``seqs``, ``seqlen``, as the
inference graphs, :mod:`.buckets`) and :class:`_Replay` puts the pair into autograd as one node whose inputs are
the encoder's trainable parameters, so everything around it is ordinary PyTorch:

- **Gradients go through autograd.** The backward graph adds each parameter's gradient into a buffer shared by the
  encoder's training graphs (one copy of the trainable parameters; zeroed first) as soon as it is computed, so the
  pass never holds every gradient at once; the node returns copies of the buffers, and
  autograd's ``AccumulateGrad`` adds those into ``.grad`` as it does for any op's gradients, so accumulation across
  chunks and steps, ``zero_grad(set_to_none=...)``, gradient hooks, ``torch.autograd.grad`` and DDP's reducer
  behave as in eager training (the copy costs one read and write of the gradients per backward; returning the
  buffers themselves would hand ``autograd.grad`` callers and hooks tensors the next backward overwrites).
- **Several forwards before one backward** (a query batch and a document batch, then one loss): each graph belongs
  to a *slot*; a forward takes the lowest slot no pending backward holds, and the graphs of one slot share one
  memory pool (only one of them can be pending at a time, so they may reuse each other's activations). A slot is
  held from the forward's replay until its backward has run or its autograd graph is freed; ``max`` slots
  (``GraphConfig.training_slots``) pending at once, a further forward runs eagerly (counted in ``describe()``).
- **What a backward replays must be what its forward saved**: one backward per forward (the captured backward
  reuses the saved activations' memory as it goes, so a second backward through the same node, after
  ``retain_graph=True``, raises instead of reading them), and a parameter changed in place between a forward and
  its backward raises, as autograd does for a saved tensor.
- **Weights are read live**: under autocast the graphs read the encoder's low-precision copies of its projection
  weights (:class:`~packed_encoders.ops.weight_cast.StaticCopies`, shared with its inference graphs), which each
  forward replay first casts again if a weight changed (an in-place or fused optimizer step), so the next replay
  sees the step; the other casts are inside the graphs. A backward whose forward read copies cast since raises.
  Replaced parameters (new storage) drop every graph (the weights fingerprint, :mod:`.route`).
- **Checked once per capture**: the warm-up runs the same forward and backward eagerly; the captured pair is
  replayed on the warm-up's inputs and must reproduce its output and gradients, or the bucket runs eagerly.
- **Warm-ups allocate in the slot's pool** (:func:`allocating_to`): their activations (a whole training step's)
  are freed into the pool, where the capture that follows reuses them. Warmed up in the general pool instead,
  they would stay reserved there beside the pool (a second activation set at the device's peak) or need an
  ``empty_cache`` the caller did not ask for.

Calls that a graph would run differently take the eager training path, the reason counted in ``describe()``:
dropout in force (a graph would replay the same masks), gradient checkpointing, inputs that require gradients
(``inputs_embeds``, ``enable_input_require_grads``), ``output_hidden_states``, sizes outside the config's bounds
(the router, :mod:`packed_encoders.router`). ``capture=False`` runs the same slots, staging and gradient buffers
with an eager forward per replay (CPU tests).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import replace

import torch
from torch import nn

from ..batch import PackedBatch
from ..errors import PackedEncodersError
from ..model.blocks import first_order
from ..model.forward import encoder_forward
from ..model.plan import rules_for
from ..ops import quack_gemm, weight_cast
from .buckets import Bucket
from .runner import StaticInputs, autocast_state, no_gc, resolve_plan, serving, verify_replay

TOO_MANY_PENDING = "more training forwards awaiting their backward than GraphConfig.training_slots"
TWICE = ("a second backward through a training-graph forward (retain_graph=True): its captured backward reuses the "
         "saved activations' memory, so each forward is backpropagated once; run this model with "
         "pe.no_cuda_graph(model) to backpropagate through a forward more than once")


class Slots:
    """Which slot indices hold a pending backward (host-only bookkeeping, one per encoder)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pending: set[int] = set()
        self.generation: dict[int, int] = {}

    def take(self) -> int | None:
        """The lowest free slot, now pending, or ``None`` when ``limit`` are pending."""
        for k in range(self.limit):
            if k not in self.pending:
                self.pending.add(k)
                self.generation[k] = self.generation.get(k, 0) + 1
                return k
        return None


class Lease:
    """A forward's hold on its slot: released by its backward, or when its autograd node is freed."""

    def __init__(self, slots: Slots, k: int):
        self.slots, self.k, self.generation = slots, k, slots.generation[k]

    def attach(self, owner) -> None:
        """Release the slot when ``owner`` (the autograd node's handle) is freed, if nothing released it before."""
        weakref.finalize(owner, Lease._free, self.slots, self.k, self.generation)

    def release(self) -> None:
        Lease._free(self.slots, self.k, self.generation)

    @staticmethod
    def _free(slots: Slots, k: int, generation: int) -> None:
        if slots.generation.get(k) == generation:
            slots.pending.discard(k)


class SlotPool:
    """A slot's graph memory pool: ``handle`` (the allocator's pool id), ``keeper`` (an empty graph captured into
    it: the allocator frees a pool when no graph uses it, and warm-ups must be able to allocate into it before
    the slot's first real capture) and ``tokens``, the largest bucket the pool has held."""

    __slots__ = ("handle", "keeper", "tokens")

    def __init__(self, stream):
        self.handle = torch.cuda.graph_pool_handle()
        self.keeper = torch.cuda.CUDAGraph()
        self.tokens = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the graph is empty: that is the point
            with torch.cuda.graph(self.keeper, pool=self.handle, stream=stream):
                pass


@contextlib.contextmanager
def allocating_to(pool, device: torch.device):
    """Within the block, every allocation on the current stream, from any thread (the autograd engine runs a CUDA
    backward on its own), comes from graph pool ``pool`` (which must exist: :class:`SlotPool`). Without the
    allocator hooks this torch lacks, allocations stay in the general pool."""
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool", None)
    if begin is None or pool is None:
        yield
        return
    index = _index(device)
    begin(index, pool)
    try:
        yield
    finally:
        torch._C._cuda_endAllocateToPool(index, pool)
        torch._C._cuda_releasePool(index, pool)  # begin took a use of the pool


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _Handle:
    """What the autograd node keeps of its forward (the finalizer releases the slot when the node is freed)."""

    __slots__ = ("runner", "lease", "total", "versions", "epoch", "done", "__weakref__")

    def __init__(self, runner, lease, total):
        self.runner, self.lease, self.total = runner, lease, total
        self.versions = versions(runner.params_list)
        self.epoch = None  # the weight copies' epoch the forward read
        self.done = False


class _Replay(torch.autograd.Function):
    """One node for the encoder: inputs the trainable parameters, output ``[T, hidden]`` (a copy of the graph's
    static output, owned by the caller)."""

    @staticmethod
    def forward(ctx, handle, *params):
        out = handle.runner.forward_replay()[:handle.total].clone()
        handle.epoch = handle.runner.epoch
        ctx.handle = handle
        handle.lease.attach(handle)
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        handle = ctx.handle
        if handle.done:  # (the slot is released only here or when the node is freed: never reused under it)
            raise PackedEncodersError(TWICE)
        changed = [i for i, (a, b) in enumerate(zip(handle.versions, versions(handle.runner.params_list))) if a != b]
        casts = handle.runner.casts
        if changed or (casts is not None and casts.epoch != handle.epoch):
            raise PackedEncodersError(f"{len(changed) or 'some'} trainable parameter(s) of the encoder were modified "
                                      "in place between the forward and its backward (a training graph's backward "
                                      "would read the new values); run the optimizer step after the backward")
        handle.done = True
        weight_cast.expire()  # (the stack's own backward, which expires them, ran at the capture only)
        grads = handle.runner.backward_replay(grad_out, handle.total)
        # The node outlives its backward while the caller holds any tensor of the step (a loop's `loss` until
        # the next step reassigns it): it must not keep the runner, whose graphs and pool a restart or an
        # eviction during the next step means to free.
        handle.runner = None
        handle.lease.release()
        return (None, *(None if g is None else g.clone() for g in grads))


class TrainRunner(StaticInputs):
    """Forward + backward of ``model`` for ``bucket``, captured into ``pool`` (its slot's).

    Outside the manager's byte budget (``budgeted``): the graph's memory is its slot's pool, which every bucket of
    the slot shares and which is as large as the largest one's activations (a step's, which the eager path holds
    at its peak too); ``GraphConfig.training_slots`` bounds it. Under the inference graphs' budget (10 % of the free
    memory by default) a large bucket's training graph would be captured, then dropped for its size.

    Args:
        params_list: the trainable parameters, in the order :class:`_Replay` takes them.
        grads: one buffer per parameter of ``params_list`` (shared by the encoder's training graphs), written by
            each backward replay.
        pool, stream, warmup, autocast, casts, query_only: as :class:`~packed_encoders.graphs.runner.GraphRunner`.
        capture: ``False`` runs the forward eagerly at each replay (keeping its autograd graph until the
            backward), on any device, differentiating the same parameter aliases as a capture.

    Raises:
        PackedEncodersError: the requested attention backend cannot run the bucket with gradients.
        RuntimeError: the forward or backward cannot be captured, or the captured pair does not reproduce its
            eager warm-up (the manager then serves the bucket eagerly and says why).
    """

    def __init__(self, model, state, bucket: Bucket, requested: str, params_list: tuple, grads: tuple, *,
                 pool=None, stream=None, warmup: int = 2, capture: bool = True, query_only: bool = False,
                 autocast=None, casts=None):
        self.budgeted = False
        self.requested, self.capture, self.model = requested, capture, model
        self.params_list, self.grads = params_list, grads
        self.casts, self.epoch = casts, 0
        weight = model.embeddings.tok_embeddings.weight
        device = self.device = weight.device
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        params = state.params
        # one node per layer block: a replay has no host cost for a stack node to save
        rules = replace(rules_for(state.tuning), stack=False)
        with on_device, torch.inference_mode(False):
            with torch.no_grad():
                batch = self._init_static(model, params, bucket, device, query_only)
            self.grad_out = None  # [tokens, hidden] in the output's dtype, made after the first forward
            self.unused: tuple = ()  # parameters the forward does not reach (their gradient stays None)
            self.plan, self.plan_summary, self.plan_reasons = resolve_plan(params, batch, requested,
                                                                           autocast or weight.dtype, state.policy,
                                                                           graph=capture, grad=True)
            ops, plan = state.ops, self.plan

            def forward():
                with autocast_state(device, autocast), serving(casts):
                    return encoder_forward(model, params, batch, attention=plan, ops=ops, rules=rules)

            self._forward = forward
            self._eager_out = self._eager_leaves = None
            self.out = None
            self.fwd_graph = self.bwd_graph = None
            if capture:
                self._capture(pool, stream, warmup)
        static = self._static_tensors() + (self.grad_out, self.out)
        self.static_bytes = sum(x.numel() * x.element_size() for x in static if x is not None)
        self.graph_bytes = self.static_bytes + getattr(self, "_pool_growth", 0)

    # ------------------------------------------------------------------------------------------ capture

    def _accumulate(self, out, leaves) -> None:
        """Backpropagate ``grad_out`` from ``out`` into the gradient buffers (zeroed first) through ``leaves``
        (aliases of the parameters, in order), recording the parameters it does not reach in ``unused``."""
        if self.grad_out is None:  # the warm-up's: random, so that the check compares real gradients
            with torch.no_grad():
                gen = torch.Generator(device=out.device).manual_seed(0)
                self.grad_out = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype) * 1e-2
        reached = set()
        hooks = []
        for i, (leaf, buf) in enumerate(zip(leaves, self.grads)):
            leaf.grad = buf  # AccumulateGrad adds into a defined .grad in place, then the parameter's gradient is freed
            hooks.append(leaf.register_post_accumulate_grad_hook(lambda _, i=i: reached.add(i)))
        try:
            torch._foreach_zero_(list(self.grads))
            torch.autograd.backward(out, self.grad_out, inputs=list(leaves))
        finally:
            for h in hooks:
                h.remove()
            for leaf in leaves:
                leaf.grad = None
        self.unused = tuple(i not in reached for i in range(len(self.grads)))

    def _capture(self, pool, stream, warmup: int) -> None:
        from .runner import _pool_bytes

        device = self.device
        before = _pool_bytes(pool, device)
        if self.casts is not None:
            self.casts.refresh()
        stream.wait_stream(torch.cuda.current_stream(device))
        # The passes differentiate fresh leaves aliasing the parameters (same storage): the parameters' own
        # AccumulateGrad nodes may live on (a pending forward's autograd graph holds them) with the caller's
        # stream, and a backward reaching them from the capture stream would wait on that stream, which
        # invalidates the capture.
        with _aliased(self.model, self.params_list) as leaves:
            with quack_gemm.graph_rules(), torch.cuda.stream(stream):
                with allocating_to(pool, device), weight_cast.off():
                    for _ in range(max(1, warmup)):
                        ref = self._forward()
                        self._accumulate(ref, leaves)
                # the check's reference output is copied out of the pool, so that the capture can reuse every
                # block the warm-ups took there
                ref = ref.detach().clone()
                ref_grads = [None if u else g.clone() for g, u in zip(self.grads, self.unused)]
            torch.cuda.current_stream(device).wait_stream(stream)
            fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            try:
                with no_gc(), quack_gemm.graph_rules():
                    with torch.cuda.graph(fwd, pool=pool, stream=stream):
                        out = self._forward()
                    with torch.cuda.graph(bwd, pool=pool, stream=stream):
                        self._accumulate(out, leaves)
                    self.out = out.detach()
                    del out  # its autograd graph (the saved activations) goes back to the pool for later captures
            except BaseException:
                _end_pool(device, pool)
                raise
        self.fwd_graph, self.bwd_graph = fwd, bwd
        self._pool_growth = max(0, _pool_bytes(pool, device) - before)
        self._verify(ref, ref_grads)

    def _verify(self, ref, ref_grads) -> None:
        """Replay both graphs on the warm-up's inputs; they must reproduce its output (as an inference graph's
        check, :func:`.runner.verify_replay`) and gradients."""
        verify_replay(self.fwd_graph, ref, self.out)
        self.bwd_graph.replay()
        for buf, want in zip(self.grads, ref_grads):
            if want is None:
                continue
            err = (buf.float() - want.float()).norm()
            if not bool(err <= 1e-2 * want.float().norm() + 1e-6):
                raise RuntimeError("the captured training backward differs from its eager warm-up "
                                   f"(relative gradient error {float(err / (want.float().norm() + 1e-12)):.3g})")

    # ------------------------------------------------------------------------------------------- replay

    def stage(self, batch: PackedBatch) -> None:
        """Copy ``batch`` (within the bucket) into the static inputs; padding becomes dummy sequences."""
        with torch.no_grad():
            self._copy_in(batch)

    def forward_replay(self) -> torch.Tensor:
        if self.casts is not None:
            self.epoch = self.casts.refresh()
        if self.fwd_graph is not None:
            self.fwd_graph.replay()
            return self.out
        with torch.enable_grad(), _aliased(self.model, self.params_list) as leaves:
            self._eager_out = self._forward()
        self._eager_leaves = leaves
        if self.grad_out is None:
            self.grad_out = torch.zeros_like(self._eager_out)
        return self._eager_out.detach()

    def backward_replay(self, grad_out: torch.Tensor, total: int) -> tuple:
        """The parameters' gradients (the shared buffers; ``None`` for parameters the forward does not reach)
        for ``grad_out`` ``[total, hidden]`` at the output."""
        with torch.no_grad():
            self.grad_out[:total].copy_(grad_out)
            self.grad_out[total:].zero_()  # padding rows: no gradient reaches the weights through them
        if self.bwd_graph is not None:
            self.bwd_graph.replay()
        else:
            out, leaves, self._eager_out, self._eager_leaves = self._eager_out, self._eager_leaves, None, None
            with torch.enable_grad():
                self._accumulate(out, leaves)
        return tuple(None if unused else g for g, unused in zip(self.grads, self.unused))


@contextlib.contextmanager
def _aliased(model: nn.Module, params: tuple):
    """Within the block, every parameter of ``params`` in ``model`` is replaced by a new leaf Parameter sharing
    its storage; yields those leaves in ``params``' order. The originals are put back on exit."""
    alias = {id(p): nn.Parameter(p.detach(), requires_grad=True) for p in params}
    swaps = []
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None and id(p) in alias:
                swaps.append((m, name, p))
                m._parameters[name] = alias[id(p)]
    try:
        yield tuple(alias[id(p)] for p in params)
    finally:
        for m, name, p in swaps:
            m._parameters[name] = p


def _end_pool(device, pool) -> None:
    """After a failed capture, stop routing the capture stream's allocations to ``pool`` (torch leaves it
    recording when the capture was invalidated; every later capture into it would fail)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None and pool is not None:
        try:
            end(_index(device), pool)
        except Exception:  # noqa: BLE001 - best effort: the manager also gives the slot a fresh pool
            pass


def versions(params: tuple) -> list[int]:
    """The in-place version counters of ``params`` (a change between forward and backward is refused)."""
    return [p._version for p in params]


def replay(runner: TrainRunner, lease: Lease, batch: PackedBatch) -> torch.Tensor:
    """Serve ``batch`` from ``runner`` under ``lease``: ``[T, hidden]`` with its autograd node."""
    runner.stage(batch)
    return _Replay.apply(_Handle(runner, lease, batch.total_tokens), *runner.params_list)
