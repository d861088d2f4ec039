"""The FLOP count over a simulation's event stream: by phase, module and op, for the first step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch._ops import OpOverload

from lightning_memest.accounting.flops.formulas import (
    FlopFormula,
    flop_formula_for,
    other_flop_formula_for,
    per_output_element,
)
from lightning_memest.accounting.replay import Observer, walk
from lightning_memest.engine.events import Event, ModuleEnter, OpEvent, Phase
from lightning_memest.report import FlopCount, ModuleFlops, OpFlops

__all__ = ["FlopObserver", "count_flops"]

_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


class FlopObserver(Observer):
    """Headline and other FLOPs of the first step (``step == 0``), by phase, module and op: an observer
    of the event stream (``accounting.replay.walk``); :attr:`count` after the walk.

    Only ops whose call was captured (``OpEvent.call``) are counted, but for elementwise ops, whose one
    FLOP per output element the event carries (``OpEvent.numel``): simulate with a capture filter that
    includes :func:`~lightning_memest.accounting.flops.captures_flops`.
    """

    def __init__(self) -> None:
        self.head = dict.fromkeys(_PHASES, 0)
        self.other = dict.fromkeys(_PHASES, 0)
        self.ran: set[Phase] = set()
        self.order: dict[str, None] = {"": None}  # modules in the order they first ran (parents first)
        # path -> [forward, backward, other_forward, other_backward], exclusive of children for now
        self.own: dict[str, list[int]] = {}
        self.per_op: dict[str, list[int]] = {}
        self.uncounted: dict[str, None] = {}
        self.formulas: dict[str, _Formulas] = {}  # op name -> its formulas, looked up once per op
        # id(call) -> (call, flops, other): replayed blocks' events share their template's call
        self.by_call: dict[int, tuple[object, int, int]] = {}
        self.count: FlopCount | None = None

    def on_module_enter(self, e: ModuleEnter) -> None:
        _add_path(self.order, e.path)

    def on_op(self, e: OpEvent) -> None:
        if e.step != 0 or e.phase not in self.head:
            return
        self.ran.add(e.phase)
        found = self.formulas.get(e.op)
        if found is None:
            found = self.formulas[e.op] = _formulas(e.call.op if e.call is not None else _resolve(e.op))
        formula, other_formula, elementwise = found
        if e.call is None:
            if not elementwise:
                return  # not captured: simulate with captures_flops in the filter
            f, o = 0, e.numel
        else:
            known = self.by_call.get(id(e.call))
            if known is not None and known[0] is e.call:
                f, o = known[1], known[2]
            else:
                try:
                    f = formula(e.call) if formula is not None else 0
                    o = other_formula(e.call) if other_formula is not None else 0
                except (AssertionError, ValueError, TypeError, IndexError, AttributeError):
                    self.uncounted[e.op] = None
                    return
                self.by_call[id(e.call)] = (e.call, f, o)
        if formula is None and other_formula is None:
            return
        self.head[e.phase] += f
        self.other[e.phase] += o
        stats = self.per_op.setdefault(e.op, [0, 0, 0])
        stats[0] += 1
        stats[1] += f
        stats[2] += o
        if e.phase is Phase.OPTIMIZER or not (f or o):
            return
        _add_path(self.order, e.module)
        figures = self.own.setdefault(e.module, [0, 0, 0, 0])
        backward = e.phase is Phase.BACKWARD
        figures[1 if backward else 0] += f
        figures[3 if backward else 2] += o

    def finish(self) -> None:
        inclusive = {path: [0, 0, 0, 0] for path in self.order}
        for path, figures in self.own.items():
            for ancestor in _ancestors(path):
                acc = inclusive[ancestor]
                for i, v in enumerate(figures):
                    acc[i] += v
        ran, head, other = self.ran, self.head, self.other
        self.count = FlopCount(
            forward=head[Phase.FORWARD],
            backward=head[Phase.BACKWARD] if Phase.BACKWARD in ran else None,
            optimizer=head[Phase.OPTIMIZER] if Phase.OPTIMIZER in ran else None,
            other_forward=other[Phase.FORWARD],
            other_backward=other[Phase.BACKWARD] if Phase.BACKWARD in ran else None,
            other_optimizer=other[Phase.OPTIMIZER] if Phase.OPTIMIZER in ran else None,
            modules=tuple(ModuleFlops(path, *inclusive[path]) for path in self.order),
            ops=tuple(
                OpFlops(name, *s)
                for name, s in sorted(self.per_op.items(), key=lambda kv: (-kv[1][1], -kv[1][2]))
            ),
            uncounted=tuple(self.uncounted),
        )


def count_flops(events: Sequence[Event]) -> FlopCount:
    """Headline and other FLOPs of the first step, by phase, module and op (a walk with
    :class:`FlopObserver`). A pure function of the events.

    Example:
        >>> import torch
        >>> from lightning_memest.engine.events import OpCall, OpEvent, Phase, TensorMeta
        >>> x, w = TensorMeta.of(torch.empty(4, 16)), TensorMeta.of(torch.empty(16, 8))
        >>> out = TensorMeta.of(torch.empty(4, 8))
        >>> call = OpCall(torch.ops.aten.mm.default, (x, w), {}, (out,), "cpu")
        >>> ev = OpEvent(0, 0, Phase.FORWARD, "fc", "aten.mm.default", call, (0,))
        >>> c = count_flops([ev])
        >>> c.forward, c.backward, c.modules
        (1024, None, (ModuleFlops(path='', forward=1024, backward=0, other_forward=0, other_backward=0), \
ModuleFlops(path='fc', forward=1024, backward=0, other_forward=0, other_backward=0)))
    """
    observer = FlopObserver()
    walk(events, observer)
    assert observer.count is not None
    return observer.count


_Formulas = tuple[FlopFormula | None, FlopFormula | None, bool]


def _formulas(op: OpOverload | None) -> _Formulas:
    """Headline formula, other formula, and whether the other one is one FLOP per output element."""
    if op is None:
        return None, None, False
    other = other_flop_formula_for(op)
    return flop_formula_for(op), other, other is per_output_element


def _resolve(name: str) -> OpOverload | None:
    """The op called ``name`` (``str(op)``, like ``"aten.add_.Tensor"``), ``None`` if unknown."""
    parts = name.split(".")
    if len(parts) != 3:
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, OpOverload) else None


def _ancestors(path: str) -> Iterable[str]:
    """``path`` and every module above it, the root ``""`` included."""
    yield ""
    if not path:
        return
    at = path.find(".")
    while at != -1:
        yield path[:at]
        at = path.find(".", at + 1)
    yield path


def _add_path(order: dict[str, None], path: str) -> None:
    if path not in order:
        for ancestor in _ancestors(path):
            order.setdefault(ancestor, None)
