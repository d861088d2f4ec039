"""Who holds what: per-module figures, per-``torch.fx``-node figures, and the tensor values the step read.

Observers of the event stream (``accounting.replay.walk``):

* :class:`ModuleFigures` -- of the first step, the activation bytes each module saved for backward
  and each module's parameter storages; :func:`module_tree` puts them with the live-bytes samples
  (each module's forward and backward high) and the FLOPs into the ``ModuleStats`` tree;
* :class:`NodeFigures` -- the same stream split by the graph node each event belongs to (the fx
  profile marks them with ``Mark`` events): what each node saves, allocates and computes
  (``NodeProfile``; ``lightning_memest.fx`` defines the figures);
* :class:`DataDependentReads` -- where a value of a fake tensor was read and what was assumed.

A storage saved by several modules (or nodes) counts once, for the first that saved it; only storages
whose final role is an activation count (parameters, buffers, the batch are resident anyway).

Example:
    >>> import torch
    >>> from lightning_memest import estimate_step
    >>> est = estimate_step(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4))
    >>> [(m.path, m.type_name, m.saved_bytes) for m in est.modules.walk()]
    [('', 'Sequential', 32), ('0', 'Linear', 0), ('1', 'ReLU', 32)]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

from lightning_memest.accounting.flops import FlopObserver
from lightning_memest.accounting.replay import Observer, OpSample
from lightning_memest.engine.events import (
    Alloc,
    DataDependent,
    Free,
    Mark,
    OpEvent,
    Phase,
    Resize,
    Role,
    Tag,
)
from lightning_memest.engine.simulate import ModuleNode
from lightning_memest.report import DataDependentRead, FlopCount, ModuleStats
from lightning_memest.report.nodes import NodeProfile

__all__ = [
    "OUTSIDE",
    "DataDependentReads",
    "ModuleFigures",
    "NodeFigures",
    "module_tree",
]

#: The owner of events that belong to no graph node (``Mark.owner``).
OUTSIDE = -1


# ------------------------------------------------------------------------------------------ modules


class ModuleFigures(Observer):
    """Of the first step: activation bytes saved per module (where autograd saved them), and each
    parameter's storage (the first path that names it)."""

    def __init__(self, roles: Mapping[int, Role]) -> None:
        self.roles = roles
        self.saved: Counter[str] = Counter()
        self.sizes: dict[int, int] = {}
        self.parameters: dict[str, int] = {}  # parameter path -> storage handle
        self._seen: set[int] = set()
        self._done = False

    def on_op(self, e: OpEvent) -> None:
        if e.step > 0:
            self._done = True  # the first step's figures

    def on_alloc(self, e: Alloc) -> None:
        if not self._done:
            self.sizes[e.storage] = e.nbytes

    def on_tag(self, e: Tag) -> None:
        if self._done:
            return
        if e.role is Role.PARAMETER:
            self.parameters.setdefault(e.module, e.storage)
        elif (
            e.role is Role.ACTIVATION
            and e.storage not in self._seen
            and self.roles.get(e.storage) is Role.ACTIVATION
        ):
            self._seen.add(e.storage)
            self.saved[e.module] += self.sizes.get(e.storage, 0)


def _ancestors(path: str) -> Iterator[str]:
    """``path`` and every module path above it, up to the root ``""``."""
    while True:
        yield path
        if not path:
            return
        path = path.rpartition(".")[0]


def module_tree(
    modules: ModuleNode, figures: ModuleFigures, samples: Sequence[OpSample], flops: FlopCount | None
) -> ModuleStats:
    """Per-module figures of the first step; each module's figures include its children's."""
    forward_high: dict[str, int] = {}
    backward_high: dict[str, int] = {}
    for s in samples:
        if s.event.step != 0:
            continue
        if s.event.phase is Phase.FORWARD:
            table = forward_high
        elif s.event.phase is Phase.BACKWARD:
            table = backward_high
        else:
            continue
        # The op counts for its module and every ancestor.
        for path in _ancestors(s.event.module):
            if s.live_bytes > table.get(path, -1):
                table[path] = s.live_bytes

    module_flops = {m.path: m for m in flops.modules} if flops is not None else {}
    sizes = figures.sizes
    # Each parameter and saved storage counts for the module that names it and every ancestor: one
    # pass over them (not one per module, which grows with the square of a deep stack's depth).
    storages: dict[str, set[int]] = {}
    saved: Counter[str] = Counter()
    for name, handle in figures.parameters.items():
        for path in _ancestors(name):
            storages.setdefault(path, set()).add(handle)
    for name, n in figures.saved.items():
        for path in _ancestors(name):
            saved[path] += n

    def build(node: ModuleNode) -> ModuleStats:
        path = node.path
        counted = module_flops.get(path)
        children = tuple(build(child) for child in node.children)
        return ModuleStats(
            path=path,
            type_name=node.type_name,
            parameter_bytes=sum(sizes[h] for h in storages.get(path, ())),
            saved_bytes=saved[path],
            forward_peak_bytes=forward_high.get(path),
            backward_peak_bytes=backward_high.get(path),
            forward_flops=None if counted is None else counted.forward,
            backward_flops=None if counted is None or path not in backward_high else counted.backward,
            children=children or None,
        )

    return build(modules)


# ----------------------------------------------------------------------------------- data-dependent


class DataDependentReads(Observer):
    """Each distinct read of a fake tensor's value (op, module, what was answered, whether exactly or
    as an upper bound) and how often."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str, bool, bool]] = Counter()

    def on_data_dependent(self, e: DataDependent) -> None:
        self.counts[(e.op, e.module, e.assumed, e.exact, e.bound)] += 1

    @property
    def reads(self) -> tuple[DataDependentRead, ...] | None:
        """The reads, ``None`` when the step read no value."""
        if not self.counts:
            return None
        return tuple(
            DataDependentRead(op, module, assumed, n, exact, bound)
            for (op, module, assumed, exact, bound), n in self.counts.items()
        )


# ------------------------------------------------------------------------------------------ fx nodes


class NodeFigures(Observer):
    """The first step's events split by graph node (``Mark`` events say which node runs, forward or
    backward): per node what it saved for backward (inputs: ``fwd_in``, its own storages:
    ``fwd_tmp``), what its backward allocated and still held when it ended (``bwd_out``) and at its
    high (``bwd_tmp``), and its FLOPs. Slot ``n`` (the node count) is what ran outside the graph."""

    def __init__(self, roles: Mapping[int, Role], node_names: Sequence[str]) -> None:
        n = len(node_names)
        self.n = n
        self.roles = roles
        self.fwd_in = [0] * (n + 1)
        self.fwd_tmp = [0] * (n + 1)
        self.own_live = [0] * (n + 1)  # bytes a slot's backward allocated that are alive now
        self.own_high = [0] * (n + 1)
        self.out_at_end = [0] * (n + 1)  # own_live when its backward last ended
        self.names = [*node_names, ""]  # "": the FLOP count's root
        self.allocated: dict[int, int] = {}  # storage -> bytes at allocation
        self.size: dict[int, int] = {}  # storage -> bytes now
        self.made_by: dict[int, tuple[int, bool]] = {}  # storage -> (slot, in backward) at allocation
        self.backward_live: dict[int, int] = {}  # storage -> slot, for storages a backward allocated
        self.seen: set[int] = set()
        self.flops = FlopObserver()  # fed the ops, with their node's name as their module
        self._mark: tuple[int, bool] = (n, False)  # the latest mark's slot and direction
        self._previous: tuple[int, bool] = (n, False)  # those of the last event seen
        self._done = False

    def on_mark(self, e: Mark) -> None:
        self._mark = (e.owner if e.owner != OUTSIDE else self.n, e.backward)

    def _slot(self) -> int:
        """The current event's slot; when it differs from the last event's, a backward may have ended."""
        current = self._mark
        previous = self._previous
        if current != previous:
            if previous[1]:
                self.out_at_end[previous[0]] = self.own_live[previous[0]]
            self._previous = current
        return current[0]

    def on_op(self, e: OpEvent) -> None:
        if e.step > 0:
            self._done = True
        if self._done:
            return
        self.flops.on_op(replace(e, module=self.names[self._slot()]))

    def on_alloc(self, e: Alloc) -> None:
        if self._done:
            return
        s = self._slot()
        backward = self._previous[1]
        self.allocated[e.storage] = self.size[e.storage] = e.nbytes
        self.made_by[e.storage] = (s, backward)
        if backward:
            self.backward_live[e.storage] = s
            self.own_live[s] += e.nbytes
            self.own_high[s] = max(self.own_high[s], self.own_live[s])

    def on_free(self, e: Free) -> None:
        if self._done:
            return
        self._slot()
        o = self.backward_live.pop(e.storage, None)
        if o is not None:
            self.own_live[o] -= self.size[e.storage]

    def on_resize(self, e: Resize) -> None:
        if self._done:
            return
        self._slot()
        o = self.backward_live.get(e.storage)
        if o is not None:
            self.own_live[o] += e.nbytes - self.size[e.storage]
            self.own_high[o] = max(self.own_high[o], self.own_live[o])
        self.size[e.storage] = e.nbytes

    def on_tag(self, e: Tag) -> None:
        if self._done:
            return
        s = self._slot()
        if (
            e.role is not Role.ACTIVATION
            or e.storage in self.seen
            or self.roles.get(e.storage) is not Role.ACTIVATION
        ):
            return
        self.seen.add(e.storage)  # counted once, for the first node that saves it
        nbytes = self.allocated.get(e.storage, 0)
        if self.made_by.get(e.storage, (-1, False))[0] == s:
            self.fwd_tmp[s] += nbytes
        else:
            self.fwd_in[s] += nbytes

    def finish(self) -> None:
        if self._previous[1]:
            self.out_at_end[self._previous[0]] = self.own_live[self._previous[0]]
        self.flops.finish()

    def profiles(
        self, nodes: Sequence[tuple[str, str, str]], outputs: Mapping[int, set[int]]
    ) -> tuple[tuple[NodeProfile, ...], NodeProfile]:
        """Each node's :class:`NodeProfile` (``nodes``: ``(name, opcode, target)`` in graph order;
        ``outputs``: a node's index -> the storage handles of its outputs), and the outside's."""
        count = self.flops.count
        node_flops = {m.path: m for m in count.modules} if count is not None else {}

        def fwd_out(i: int) -> int:
            handles = outputs.get(i, set())
            return sum(self.allocated.get(h, 0) for h in handles if self.made_by.get(h) == (i, False))

        profiles = []
        for i, (name, opcode, target) in enumerate(nodes):
            counted = node_flops.get(name)
            profiles.append(
                NodeProfile(
                    name=name,
                    op=opcode,
                    target=target,
                    fwd_in=self.fwd_in[i],
                    fwd_tmp=self.fwd_tmp[i],
                    fwd_out=fwd_out(i),
                    bwd_tmp=max(self.own_high[i] - self.out_at_end[i], 0),
                    bwd_out=self.out_at_end[i],
                    fwd_flops=counted.forward if counted else 0,
                    bwd_flops=counted.backward if counted else 0,
                    fwd_other_flops=counted.other_forward if counted else 0,
                    bwd_other_flops=counted.other_backward if counted else 0,
                )
            )
        root = node_flops.get("")

        def rest(field_name: str) -> int:
            total = getattr(root, field_name) if root is not None else 0
            return int(
                total - sum(getattr(node_flops[p.name], field_name) for p in profiles if p.name in node_flops)
            )

        n = self.n
        outside = NodeProfile(
            name="(outside)",
            op="outside",
            target="loss",
            fwd_in=self.fwd_in[n],
            fwd_tmp=self.fwd_tmp[n],
            fwd_out=0,
            bwd_tmp=max(self.own_high[n] - self.out_at_end[n], 0),
            bwd_out=self.out_at_end[n],
            fwd_flops=rest("forward"),
            bwd_flops=rest("backward"),
            fwd_other_flops=rest("other_forward"),
            bwd_other_flops=rest("other_backward"),
        )
        return tuple(profiles), outside
