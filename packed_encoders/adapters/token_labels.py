"""Heads that read the encoder's output at padded positions: those calls get stock's encoder output there.

The packed encoder's output is zero at padded positions. HF's token-classification and masked-LM heads compute
their loss over every position whose label is not the ignore index (-100): HF's collators give padded positions
-100, but labels built by hand (``labels = input_ids.clone()``, labels padded with a class id) reach padded
positions, and there stock's encoder output (attention of the padded query over the real keys) enters the loss.
A masked-LM head with ``sparse_prediction`` also drops positions labelled ``sparse_pred_ignore_index`` before its
decoder: those labels count no more than -100 does.

``pack(target)`` with any ``padded_outputs`` but ``"zeros"`` replaces the ``forward`` of each such head inside
``target`` on the instance with a :class:`CheckedForward` (not a module hook: ``head.forward(...)`` runs no hook),
which reads the call's labels and then runs the head's own forward. A call passing ``labels`` and ``attention_mask``
(by keyword or position) is checked, with one device-to-host read: when no label at a padded position counts,
nothing changes; when the counted ones all sit after their row's last real token, the encoder call computes those
trailing positions as stock does (the path of ``padded_outputs="all"``); otherwise (padding before real tokens, or a
row without real tokens, where stock attends over the padding) the encoder call runs the stock forward, counted in
``describe()["encoders"][i]["stock_forward_calls"]``. The request holds for every encoder call the head's forward
makes on this thread (:func:`head_request`) and is cleared when it returns. The head is recorded around its encoder
(:mod:`.around`): the check stays while an encoder inside the head is packed with a ``padded_outputs`` other than
``"zeros"``, whatever ``pack()``'s target (``pe.pack(head.model)`` after ``pe.pack(head)`` keeps it,
``pe.pack(head)`` after ``pe.pack(head.model)`` adds it), and :func:`sync` restores the head's forward (its earlier
instance forward, or the class forward) once none is (``pe.unpack(head.model)``) or the head is forgotten
(``pe.unpack(head)``).

Sequence-classification and multiple-choice heads with ``config.classifier_pooling == "cls"`` read the encoder's
output at position 0 of each row (read live at each call: the config is shared with the encoder and may change
after ``pack()``). Where a row is padded there (left padding, or a row without real tokens), stock's output at
that padded position is what the head classifies. ``pack(target)`` marks each encoder inside such a head
(recorded around it, :mod:`.around`; read by :func:`position_zero_reader`; not a hook: sentence-transformers'
``CrossEncoder`` calls ``head.forward`` directly, which runs no hook), and every padded call of that encoder while
``classifier_pooling == "cls"`` checks position 0 of every row at the call's one sync and runs the stock forward
when any is padded (counted as above); right-padded calls stay packed. The multiple-choice head reads each row's
first real token (``attention_mask.argmax(-1)``), so only a row without real tokens (read at position 0) runs the
stock forward there.

Question-answering heads take their span loss's softmax over every position of the row, padded ones included, so
``pack(target)`` computes trailing padded positions as stock does for every call of an encoder inside one
(``configure.read_around``); a call passing ``start_positions`` or ``end_positions`` with padding before a
row's last real token (left padding) runs the stock forward, counted as above, since the packed path has no
values for those positions.
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch
from torch import nn

from .around import CHECK_SUFFIXES, SPAN_SUFFIX, head_suffix, is_checked, label_heads
from .dynamo import outside_dynamo
from .state import (_NO_FORWARD, STATE_ATTR, forward_bypassed, get_state, instance_forward, own_forward,
                    rebound_args)
from .stock_calls import positional_names, stock_signature

IGNORE_INDEX = -100  # HF's CrossEntropyLoss default, used by both heads
STOCK_REASON = ("labels at padded positions before a row's last real token (the loss reads the encoder's output "
                "there, which the packed path leaves at zero)")
EMPTY_ROW_REASON = ("labels at positions of a row without real tokens (stock's encoder output there attends over "
                    "the row's padding, which the packed path does not compute)")
SPAN_STOCK_REASON = ("a question-answering loss (start_positions / end_positions) with padding before a row's last "
                     "real token: its softmax reads the encoder's output at every position, and the packed path "
                     "computes only trailing padded positions as stock does")
SPAN_EMPTY_ROW_REASON = ("a question-answering loss (start_positions / end_positions) with a row without real "
                         "tokens: its softmax reads stock's encoder output there, which attends over the row's padding "
                         "and which the packed path does not compute")
BYPASSED_REASON = ("a head's label check was taken off its forward (the class forward set back on the instance, as "
                   "accelerate's remove_hook_from_module does for a hook added before pack()): the check is put back, "
                   "and this call, whose labels went unread, runs the stock forward")
TRAILING = "trailing"
_REQUEST = threading.local()


def _after_last(real: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: no real token at or after the position (``real``: the mask's real positions)."""
    return real.flip(1).cumsum(1).flip(1) == 0


def request_for(labels, attention_mask, also_ignored: int | None = None) -> str | None:
    """``None`` (no label at a padded position counts), :data:`TRAILING` (all of them after their row's last real
    token) or why the call must run the stock forward (:data:`STOCK_REASON`; :data:`EMPTY_ROW_REASON`: a counted
    label in a row without real tokens), for ``attention_mask`` ``[B, S]`` and ``labels`` of ``B * S`` entries
    (HF's heads flatten them: ``[B, S]``, ``[B * S]`` and ``[B, S, 1]`` count alike); anything else ``None``.
    ``also_ignored``: a second label value that does not count (a sparse masked-LM head's
    ``sparse_pred_ignore_index``, whose positions the head drops before its decoder and loss)."""
    if not (isinstance(labels, torch.Tensor) and isinstance(attention_mask, torch.Tensor)):
        return None
    if attention_mask.dim() != 2 or labels.numel() != attention_mask.numel():
        return None
    # HF's heads move labels to the logits' device for the loss: CPU labels of a CUDA call count all the same
    labels = labels.to(attention_mask.device, non_blocking=True).reshape(attention_mask.shape)
    real = attention_mask != 0
    counted = ~real & (labels != IGNORE_INDEX)
    if also_ignored is not None:
        counted &= labels != also_ignored
    after_last = _after_last(real)
    empty = ~real.any(1, keepdim=True)
    any_counted, inner, in_empty = torch.stack((counted.any(), (counted & ~after_last).any(),
                                                (counted & empty).any())).tolist()
    if not any_counted:
        return None
    if in_empty:
        return EMPTY_ROW_REASON
    return STOCK_REASON if inner else TRAILING


def span_request_for(start_positions, end_positions, attention_mask) -> str | None:
    """:data:`SPAN_STOCK_REASON` when a question-answering call asks for its loss (``start_positions`` or
    ``end_positions`` given) and ``attention_mask`` ``[B, S]`` has padding before a row's last real token,
    :data:`SPAN_EMPTY_ROW_REASON` when it has a row without real tokens (one device-to-host read), else ``None``."""
    if start_positions is None and end_positions is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return None
    real = attention_mask != 0
    before_last = ~real & ~_after_last(real)  # padded, with a real token after it
    inner, empty = torch.stack((before_last.any(), (~real.any(1)).any())).tolist()
    if inner:
        return SPAN_STOCK_REASON
    return SPAN_EMPTY_ROW_REASON if empty else None


def _arguments(module, args, kwargs, *names):
    """``names``' values in this call, keyword or positional: ``head(ids, mask, labels=...)`` is as common as the
    Trainer's all-keyword call, and a mask missed here would leave the loss reading the packed path's zeros."""
    if not args:
        return tuple(kwargs.get(name) for name in names)
    positional = dict(zip(positional_names(type(module)), args))
    return tuple(kwargs[name] if name in kwargs else positional.get(name) for name in names)


class CheckedForward:
    """The instance ``forward`` :func:`sync` puts on a token-classification, masked-LM or question-answering head
    (picklable, deepcopy-safe, as the encoder's ``PackedForward``): it reads the call's labels (span positions) and
    hands the request to the encoder call the head makes, then runs the head's own forward. An instance forward
    rather than a module hook, so ``head.forward(...)`` (which runs no hook) is checked as ``head(...)`` is.

    The check runs while one of ``encoders`` (the packed encoders inside the head at ``pack()``) is packed with a
    ``padded_outputs`` other than ``"zeros"``: a reference kept after ``unpack()`` (a wrapper set over it, such as
    accelerate's) runs ``previous`` (the instance forward it replaced) or the class forward, unchecked."""

    # a method bound to it (state.instance_forward) pickles as getattr(module, __func__.__name__): the unpickled
    # module's class forward, which pack() replaces again (describe() says "bypassed" until then)
    __name__ = "forward"

    def __init__(self, module: nn.Module, previous, span: bool, encoders: tuple):
        self.module = module
        self.previous = previous
        self.span = span
        self.encoders = encoders

    @property
    def encoders(self) -> tuple:
        """The encoders whose packed state turns the check on, held weakly: an encoder replaced on the head
        (``head.model = other``) is not kept alive by the head's check."""
        return tuple(e for e in (r() for r in self.__dict__.get("_encoders", ())) if e is not None)

    @encoders.setter
    def encoders(self, encoders) -> None:
        self._encoders = tuple(weakref.ref(e) for e in encoders)

    def __getstate__(self) -> dict:
        # pickled and deep-copied with the encoders themselves (a weak reference neither pickles nor follows a copy),
        # those still inside the head: one replaced since (head.model = other) would be saved or copied along
        state = {k: v for k, v in self.__dict__.items() if k != "_encoders"}
        inside = {id(m) for m in self.module.modules()}
        state["encoders"] = tuple(e for e in self.encoders if id(e) in inside)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        encoders = state.pop("encoders", ())
        self.__dict__.update(state)
        self.encoders = encoders

    def __call__(self, *args, **kwargs):
        args = rebound_args(self, args)
        for encoder in self.encoders:
            state = encoder.__dict__.get(STATE_ATTR)
            if state is not None and state.options.padded_outputs != "zeros":
                if torch.compiler.is_dynamo_compiling():  # the check reads the labels on the host
                    call, request = _outside_dynamo()
                    return call(self, args, kwargs, request)
                return _checked_call(self, args, kwargs)
        return self.run(args, kwargs)

    def run(self, args, kwargs):
        """The head's own forward: ``previous``, or the class forward."""
        previous = self.previous
        if isinstance(previous, str):
            return type(self.module).forward(self.module, *args, **kwargs)
        return previous(*args, **kwargs)

    @property
    def __signature__(self):
        """The head's own forward's signature (the Trainer reads ``inspect.signature(model.forward)`` to keep the
        dataset's columns the model takes)."""
        if isinstance(self.previous, str):
            return stock_signature(type(self.module))
        return inspect.signature(self.previous)

    @property
    def __code__(self):
        """The head's own forward's code object (``torch.export`` reads ``model.forward.__code__``)."""
        if isinstance(self.previous, str):
            return type(self.module).forward.__code__
        return self.previous.__code__

    def __repr__(self) -> str:
        return f"<packed_encoders label check around {type(self.module).__name__}.forward>"


class CheckedReplicator:
    """Instance ``_replicate_for_data_parallel`` of a checked head: ``nn.DataParallel`` replicas copy ``__dict__``
    shallowly, which would leave each replica's checked forward running the original head; each replica gets its
    own (its encoders' packed state is a copy of the original's, so the original's encoders tell when to check)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self):
        replica = type(self.module)._replicate_for_data_parallel(self.module)
        checked = replica.__dict__.get("forward")
        if isinstance(checked, CheckedForward) and checked.module is self.module:
            replica.__dict__["forward"] = CheckedForward(replica, checked.previous, checked.span, checked.encoders)
        replica.__dict__["_replicate_for_data_parallel"] = CheckedReplicator(replica)
        return replica


def _request(checked: CheckedForward, args, kwargs) -> str | None:
    """The request of this call of ``checked``'s head (:func:`span_request_for` / :func:`request_for`)."""
    module = checked.module
    if checked.span:
        return span_request_for(*_arguments(module, args, kwargs, "start_positions", "end_positions",
                                            "attention_mask"))
    return request_for(*_arguments(module, args, kwargs, "labels", "attention_mask"),
                       also_ignored=_sparse_ignore_index(module))


def _sparse_ignore_index(module: nn.Module) -> int | None:
    """A masked-LM head with ``sparse_prediction`` (read live, as its forward reads it) keeps only the positions whose
    label is not ``sparse_pred_ignore_index`` for its decoder and loss: labels of that value read nothing there, and
    count no more than -100 does (labels padded with the configured ignore index, as a sparse-MLM collator writes
    them, then need neither the trailing positions computed nor the stock forward)."""
    if not getattr(module, "sparse_prediction", False):
        return None
    index = getattr(module, "sparse_pred_ignore_index", None)
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def _checked_call(checked: CheckedForward, args, kwargs, request=_request):
    if torch.compiler.is_exporting() or torch.jit.is_tracing():  # the encoder traces the stock forward
        # (stock_calls.EXPORT / JIT_TRACE): nothing to ask, and a host read of the labels would be a trace constant
        return checked.run(args, kwargs)
    outer = getattr(_REQUEST, "what", None)  # (a checked head called inside another's forward)
    _REQUEST.what = request(checked, args, kwargs)
    try:
        return checked.run(args, kwargs)
    finally:
        _REQUEST.what = outer


def _outside_dynamo() -> tuple:
    """Under torch.compile the check runs outside dynamo's graph: the call (recursive=False: the head's forward it runs
    is compiled on its own, up to the encoder, itself outside the graph) and the labels' host read (recursive, so
    dynamo does not trace it into a graph break)."""
    return outside_dynamo(_checked_call, recursive=False), outside_dynamo(_request)


def head_request() -> str | None:
    """The request of the checked head whose forward is running on this thread, for every encoder call it makes (a
    head may call its encoder more than once; a request never changes a result, only how it is computed):
    ``None``, :data:`TRAILING`, or why the call must run the stock forward (:data:`STOCK_REASON`,
    :data:`EMPTY_ROW_REASON`, :data:`SPAN_STOCK_REASON`, :data:`SPAN_EMPTY_ROW_REASON`)."""
    return getattr(_REQUEST, "what", None)


def token_heads(target: nn.Module) -> list[nn.Module]:
    """The token-classification, masked-LM and question-answering heads inside ``target`` (by class name, as HF
    names them, or a subclass's: :func:`.around.head_suffix`)."""
    return [m for m in target.modules() if head_suffix(m) in CHECK_SUFFIXES]


def position_zero_reader(model: nn.Module, state) -> str | None:
    """What the head holding ``model`` reads of each row in this call (:data:`COLUMN_ZERO`, :data:`FIRST_REAL`), or
    ``None``: no such head was around it at ``pack()`` (:mod:`.around`), or its ``classifier_pooling`` (the
    encoder's config, read live) is not ``"cls"``."""
    reads = getattr(state, "position_zero", None)
    if reads is None or getattr(model.config, "classifier_pooling", None) != "cls":
        return None
    return reads


def sync(heads) -> list:
    """Put a :class:`CheckedForward` (and a :class:`CheckedReplicator`) on each of ``heads`` that is recorded as
    checking its labels (:func:`.around.is_checked`) and holds an encoder packed with a ``padded_outputs`` other
    than ``"zeros"`` (once; its ``encoders`` brought up to date, and marked ``label_checked``), and take them off
    the others, restoring the head's forward (its earlier instance forward, or none: the class forward). A forward
    set over the checked one after ``pack()`` (a wrapper such as accelerate's) is kept; the checked forward it calls
    stops checking once its encoders are unpacked, and is the one brought up to date when the head is packed again
    (no second check over the wrapper). Returns the heads given a check they did not have."""
    _outside_dynamo()
    given = []
    for head in heads:
        encoders = tuple(m for m in head.modules() if get_state(m) is not None)
        _drop_shared(head)
        current = instance_forward(head, _NO_FORWARD)
        # ours on the instance, or under a wrapper set over it since (accelerate's hook calls it through
        # module._old_forward, and its removal puts it back on the instance): that one check follows the head's
        # encoders. A new check over the wrapper would leave the old one under it checking for the encoders it held
        # (a replaced encoder's calls unchecked once the hook is removed), and check each call twice meanwhile
        own = own_forward(head, current, CheckedForward)
        if is_checked(head) and any(get_state(m).options.padded_outputs != "zeros" for m in encoders):
            if own is not None:  # packed again
                own.encoders = encoders
                if own is current:
                    head.__dict__["forward"] = current
            else:
                span = head_suffix(head) == SPAN_SUFFIX
                head.__dict__["forward"] = CheckedForward(head, current, span, encoders)
                given.append(head)
            head.__dict__.setdefault("_replicate_for_data_parallel", CheckedReplicator(head))
            for encoder in encoders:
                get_state(encoder).label_checked = True
            continue
        if own is not None:
            if own is current:
                del head.__dict__["forward"]
                if not isinstance(current.previous, str):
                    head.__dict__["forward"] = current.previous
            own.encoders = ()  # a wrapper over it (which stays) or a reference kept elsewhere runs the head unchecked
        replicator = head.__dict__.get("_replicate_for_data_parallel")
        if isinstance(replicator, CheckedReplicator) and replicator.module is head:
            del head.__dict__["_replicate_for_data_parallel"]
    return given


def _drop_shared(head: nn.Module) -> None:
    """Take off ``head`` the check and replicator of another head: a shallow copy (``copy.copy``) shares its
    original's ``__dict__`` values, whose check runs the original's forward and, once the shared encoder is
    unpacked, would stay on the copy; the copy gets its own where it is checked (:func:`sync`)."""
    current = head.__dict__.get("forward")
    if isinstance(current, CheckedForward) and current.module is not head:
        del head.__dict__["forward"]
        if not isinstance(current.previous, str):
            head.__dict__["forward"] = current.previous
    replicator = head.__dict__.get("_replicate_for_data_parallel")
    if isinstance(replicator, CheckedReplicator) and replicator.module is not head:
        del head.__dict__["_replicate_for_data_parallel"]


def restore_bypassed(model: nn.Module, state) -> str | None:
    """:data:`BYPASSED_REASON` when a head checking the labels of ``model`` (whose ``state`` a head has checked)
    ran its class forward instead of its check (:func:`.state.forward_bypassed`) and the check was put back
    (:func:`sync`), else ``None``. The encoder's call runs the stock forward then: it may come from that head, whose
    labels no check read."""
    if not state.label_checked:
        return None
    bypassed = [head for head in label_heads(model) if forward_bypassed(head)]
    return BYPASSED_REASON if bypassed and sync(bypassed) else None
