"""The fake mode of a simulation: ``FakeTensorMode`` that reports each op it runs to a ``Tracker``.

Besides running ops on fake tensors it decides, per op, what reaches the tracker: ops run inside
another op are not the step's; under ``inference_mode`` a composite op is decomposed as a real run
would; an optimizer's in-place update of its own fake tensors skips the fake kernel (it allocates
nothing); a sparse tensor's rule builds outputs from its parts (``engine.sparse``); and the values the
simulation knows are carried from op to op (``engine.values.value_sets``, ``engine.real_path``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch._subclasses.fake_tensor as _fake_tensor
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_memest.engine.events import Phase
from lightning_memest.engine.higher_order_ops import register_composites
from lightning_memest.engine.pointer_kernels import pointer_kernels
from lightning_memest.engine.real_path import known_value
from lightning_memest.engine.sparse import carry_indices, sparse_rule
from lightning_memest.engine.tracker import Tracker, real_value
from lightning_memest.engine.values import data_dependent
from lightning_memest.engine.values.value_sets import carry_value_sets, remember_written_sets

__all__ = ["TrackingFakeTensorMode"]

_aten = torch.ops.aten
#: What the fake mode's ``dispatch`` answers before anything else, from the fake tensor's own fields
#: (``prim.device``, ``aten.size``, ``aten.stride``, ...): answered the same way, without its wrappers.
_METADATA_QUERIES: Mapping[Any, Any] = getattr(_fake_tensor, "_DISPATCH_META_HANDLERS", {})
_SKIP_OPS = frozenset({torch.ops.aten.detach.default, torch.ops.prim.device.default})
#: In-place elementwise updates of torch.optim's for-loop implementations: the result is ``self``.
_IN_PLACE_UPDATES = frozenset(
    {
        _aten.add_.Tensor,
        _aten.add_.Scalar,
        _aten.sub_.Tensor,
        _aten.sub_.Scalar,
        _aten.mul_.Tensor,
        _aten.mul_.Scalar,
        _aten.div_.Tensor,
        _aten.div_.Scalar,
        _aten.lerp_.Scalar,
        _aten.lerp_.Tensor,
        _aten.addcmul_.default,
        _aten.addcdiv_.default,
        _aten.sqrt_.default,
    }
)


class TrackingFakeTensorMode(FakeTensorMode):  # type: ignore[no-untyped-call]
    """A ``FakeTensorMode`` that reports each op it runs to a :class:`Tracker`.

    One mode rather than a tracking mode stacked above the fake one: a second Python dispatch layer
    per op would double the estimator's cost. Ops the fake mode runs inside another op (its own
    decompositions) are not reported: the real kernel of the outer op does not allocate them either.
    """

    def __init__(self, tracker: Tracker) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.tracker = tracker
        tracker.mode = self
        self._depth = 0
        self._entered: list[ExitStack] = []

    def __enter__(self) -> TrackingFakeTensorMode:
        # Kernels that write through data pointers are replaced while the mode is on (once: policies enter
        # it again to make their tensors).
        stack = ExitStack()
        if not self._entered:
            stack.enter_context(pointer_kernels(real_value))
        self._entered.append(stack)
        try:
            return super().__enter__()
        except BaseException:
            self._entered.pop().close()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._entered.pop().close()

    def _answer(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> data_dependent.Answer | None:
        """The data-dependent policy's answer, its tensors made in this mode (fake) and not reported: the
        op's outputs are, as the op's."""
        with self.untracked(), self:
            return data_dependent.answer(func, args, kwargs, real_value)

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Ops inside run on fake tensors but are not reported (they are not part of the step)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> Any:
        metadata = _METADATA_QUERIES.get(func)
        if metadata is not None:
            # A tensor's device or sizes asked through dispatch (autograd's engine asks for every
            # gradient's device): the fake mode answers these first thing, without running an op.
            return metadata(args)
        if _writes_layout(func):
            self.tracker.layout_writes += 1
        kwargs = dict(kwargs or {})
        if self._depth:
            # An op run inside another (a fake kernel's own ops, a policy's): not part of the step. Not
            # reported, and the fake mode's own ``dispatch`` runs it, not a wrapper of it: no values are
            # computed for it (``engine.real_path`` -- a meta kernel's ``self.new_empty(...)`` would get
            # the garbage of a real ``new_empty`` as the values of the op's output).
            return FakeTensorMode.dispatch(self, func, types, args, kwargs)
        if func in _SKIP_OPS or func.namespace == "profiler":
            return super().__torch_dispatch__(func, types, args, kwargs)
        if _composite(func) and not _takes_nested(args):
            # Under inference_mode (no autograd key) a composite op (conv2d, linear, layer_norm) reaches
            # the mode whole; a real run decomposes it into the ops the kernel models, the FLOP formulas
            # and the calibration know (convolution, addmm): so must the simulation, at this level.
            # The C++ composite, not a Python decomposition registered for tracing (upsample_bilinear2d's
            # computes with a dozen elementwise ops the real kernel does not make).
            with self:
                return func._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args, **kwargs)

        if func in _IN_PLACE_UPDATES and self.tracker.phase is Phase.OPTIMIZER and self._own(args, kwargs):
            # An optimizer's in-place update of a fake tensor: its result is its first argument and it
            # allocates nothing, so the fake kernel (a third of a simulation's time under Adam's
            # for-loop) is skipped. Only there: in forward and backward, in-place ops bump version
            # counters that autograd checks.
            def update() -> Any:
                return args[0]

            return self.tracker.run_op(update, func, tuple(args), kwargs)

        rule = sparse_rule(func, args)

        def run() -> Any:
            self._depth += 1
            try:
                if rule is not None:  # a sparse tensor's entries, which the fake kernel loses
                    # (a rule that cannot know the entries takes the most: every index distinct)
                    note = functools.partial(self.tracker.value_read, func, bound=True)
                    backward = self.tracker.phase is Phase.BACKWARD
                    out, self.tracker.workspace = rule(func, args, kwargs, note, backward)
                    return out
                return super(TrackingFakeTensorMode, self).__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._depth -= 1

        remember_written_sets(func, args, real_value)  # what a write is about to forget
        out = self.tracker.run_op(run, func, tuple(args), kwargs, self._answer)
        carry_value_sets(func, args, out, real_value, kwargs)
        carry_indices(func, args, out, real_value)
        return out

    def _own(self, args: Sequence[object], kwargs: Mapping[str, object]) -> bool:
        """Whether every tensor argument is a fake tensor of this mode (the first one a tensor without a
        constant or known value: the fake kernel keeps values of small tensors made from numbers, such
        as an optimizer's step counter, which ``.item()`` reads; ``engine.real_path`` updates or forgets
        the known value of a small parameter as the update writes it)."""
        first = args[0]
        if not isinstance(first, FakeTensor) or first.constant is not None or known_value(first) is not None:
            return False
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor) and not (isinstance(a, FakeTensor) and a.fake_mode is self):
                return False
        return True


@functools.cache
def _writes_layout(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` can change the shape, strides, offset or storage of a tensor it is given: the
    in-place views (``t_``, ``as_strided_``, ``set_``, ``resize_``: tagged so) and ``out=`` ops, which
    resize their ``out``. In-place arithmetic (``add_``) cannot: it refuses another shape."""
    return torch.Tag.inplace_view in func.tags or any(a.is_out for a in func._schema.arguments)


@functools.cache
def _composite(func: torch._ops.OpOverload) -> bool:
    """Whether a real run decomposes ``func``: CompositeImplicitAutograd (a composition of other aten
    ops) with no kernel of its own for the CPU or CUDA (``silu_backward`` has both: it runs whole), and
    returning tensors (``is_nonzero``, ``item``, reads of a value, keep their names in the report)."""
    returns = func._schema.returns
    if not returns or not all(isinstance(r.type, torch.TensorType) for r in returns):
        return False
    name = func.name()  # type: ignore[no-untyped-call]
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    keys = torch._C.DispatchKey
    return has(name, keys.CompositeImplicitAutograd) and not has(name, keys.CPU) and not has(name, keys.CUDA)


def _takes_nested(args: Sequence[object]) -> bool:
    """Whether a real nested tensor is among the arguments (made by an op run for real,
    ``engine.real_ops``): its own kernel runs it, not the dense composite."""
    return any(type(a) is Tensor and a.is_nested for a in args)


# flex_attention's eager composite runs inside the mode (its ops the step's): engine.higher_order_ops
register_composites(TrackingFakeTensorMode)
