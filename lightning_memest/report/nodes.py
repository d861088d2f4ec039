"""The report of a ``torch.fx`` node profile (``lightning_memest.fx``): what each graph node saves for
backward, allocates and computes in one training step, as rows, JSON and a text table. Filled by
``accounting/attribution.py``; like ``report.py``, a vocabulary importing nothing of the package but it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch.fx

from lightning_memest.constants import NODE_ORDERS
from lightning_memest.report import format_bytes, human_flops, render_columns

__all__ = ["NODE_ORDERS", "GraphProfile", "GraphTotals", "NodeProfile"]


@dataclass(frozen=True, slots=True)
class NodeProfile:
    """What one ``torch.fx`` graph node does in a training step (``lightning_memest.fx`` says what each
    figure means)."""

    name: str
    op: str
    """The fx opcode: ``placeholder``, ``get_attr``, ``call_function``, ``call_method``, ``call_module``,
    ``output`` (``outside`` for what ran outside the graph)."""
    target: str
    """The module path (``call_module``), method name, attribute path, or qualified function name."""
    fwd_in: int
    fwd_tmp: int
    fwd_out: int
    bwd_tmp: int
    bwd_out: int
    fwd_flops: int
    bwd_flops: int
    fwd_other_flops: int
    bwd_other_flops: int

    @property
    def saved(self) -> int:
        """Bytes this node keeps alive for backward: ``fwd_in + fwd_tmp``."""
        return self.fwd_in + self.fwd_tmp

    @property
    def flops(self) -> int:
        """Headline FLOPs of its forward and backward."""
        return self.fwd_flops + self.bwd_flops


@dataclass(frozen=True, slots=True)
class GraphTotals:
    """Sums over the nodes and :attr:`GraphProfile.outside`."""

    saved_bytes: int
    """Activation bytes of the step: equals ``estimate_step(...).modules.saved_bytes`` (first step)."""
    fwd_flops: int
    bwd_flops: int
    fwd_other_flops: int
    bwd_other_flops: int


@dataclass(frozen=True, repr=False)
class GraphProfile:
    """The node-level profile of one training step (first step; see ``fx.profile_graph``).

    ``print(profile)`` is one line for people (:meth:`table` has the nodes); ``repr`` counts the
    nodes rather than listing them.
    """

    nodes: tuple[NodeProfile, ...]
    """One per graph node, in graph order."""
    outside: NodeProfile
    """What ran outside the graph: the loss, the seed gradient of backward, and the like."""
    device: str
    precision: str
    seconds: float
    """Wall seconds of the simulation."""
    graph_module: torch.fx.GraphModule = field(repr=False, compare=False)
    """The graph that ran (the one given, or the trace of the module given); see ``fx.annotate``."""
    approximate: bool = False
    """A CUDA what-if on a machine without a GPU (as ``StepEstimate.approximate``)."""

    def __repr__(self) -> str:
        t = self.totals
        return (
            f"<GraphProfile {self.device} {self.precision}: {len(self.nodes):,} nodes, saved "
            f"{t.saved_bytes:,} B, {t.fwd_flops + t.bwd_flops:,} FLOPs>"
        )

    def __str__(self) -> str:
        t = self.totals
        return (
            f"Node profile ({self.device}, {self.precision}; first step): {len(self.nodes)} nodes save "
            f"{format_bytes(t.saved_bytes)} for backward; forward {human_flops(t.fwd_flops)}, backward "
            f"{human_flops(t.bwd_flops)}"
        )

    @property
    def totals(self) -> GraphTotals:
        every = (*self.nodes, self.outside)
        return GraphTotals(
            saved_bytes=sum(n.saved for n in every),
            fwd_flops=sum(n.fwd_flops for n in every),
            bwd_flops=sum(n.bwd_flops for n in every),
            fwd_other_flops=sum(n.fwd_other_flops for n in every),
            bwd_other_flops=sum(n.bwd_other_flops for n in every),
        )

    def node(self, name: str) -> NodeProfile:
        """The profile of the node called ``name`` (``KeyError`` if there is none)."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def ordered(self, by: str = "graph", top: int | None = None) -> list[NodeProfile]:
        """The nodes in graph order (``by="graph"``) or by a figure, largest first; the first ``top``."""
        if by not in NODE_ORDERS:
            raise ValueError(f"by must be one of {', '.join(NODE_ORDERS)}; got {by!r}")
        if top is not None and top < 0:
            raise ValueError(f"top must be at least 0; got {top}")
        nodes = list(self.nodes)
        if by != "graph":
            nodes.sort(key=lambda n: getattr(n, by), reverse=True)  # stable: graph order among ties
        return nodes if top is None else nodes[:top]

    def rows(self, by: str = "graph", top: int | None = None) -> list[dict[str, Any]]:
        """Plain data, one dict per node (its fields and ``saved``), for ``--json``."""
        return [_row(n) for n in self.ordered(by, top)]

    def to_json(self, by: str = "graph", top: int | None = None) -> dict[str, Any]:
        """``{"nodes": rows, "outside": row, "totals": {...}, "device", "precision", "seconds",
        "approximate"}``."""
        return {
            "nodes": self.rows(by, top),
            "outside": _row(self.outside),
            "totals": asdict(self.totals),
            "device": self.device,
            "precision": self.precision,
            "seconds": round(self.seconds, 4),
            "approximate": self.approximate,
        }

    def table(self, top: int | None = None, by: str = "graph") -> str:
        """A text table: one row per node (bytes in binary units, FLOPs in decimal ones), then the
        ``(outside)`` row and the totals.

        Example:
            >>> import torch
            >>> from lightning_memest.fx import profile_graph
            >>> p = profile_graph(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
            ...                   torch.randn(2, 8))
            >>> print(p.table(top=1, by="saved"))
            node       op           target  fwd_in  fwd_tmp  fwd_out  bwd_tmp  bwd_out  fwd FLOPs  bwd FLOPs
            _1         call_module  1          0 B     64 B     64 B      0 B     64 B     0 FLOP     0 FLOP
            (outside)  outside      loss       0 B      0 B      0 B      0 B      4 B     0 FLOP     0 FLOP
            total                              0 B     64 B                              256 FLOP   256 FLOP
        """
        shown = self.ordered(by, top)
        header = (
            "node",
            "op",
            "target",
            "fwd_in",
            "fwd_tmp",
            "fwd_out",
            "bwd_tmp",
            "bwd_out",
            "fwd FLOPs",
            "bwd FLOPs",
        )
        body = [_cells(n) for n in (*shown, self.outside)]
        t = self.totals
        saved_in = sum(n.fwd_in for n in (*self.nodes, self.outside))
        total = (
            "total",
            "",
            "",
            format_bytes(saved_in),
            format_bytes(t.saved_bytes - saved_in),
            "",
            "",
            "",
            human_flops(t.fwd_flops),
            human_flops(t.bwd_flops),
        )
        return render_columns([header, *body, total], right_from=3)


def _row(n: NodeProfile) -> dict[str, Any]:
    row = asdict(n)
    row["saved"] = n.saved
    return row


def _cells(n: NodeProfile) -> tuple[str, ...]:
    return (
        n.name,
        n.op,
        _shorten(n.target, 40),
        format_bytes(n.fwd_in),
        format_bytes(n.fwd_tmp),
        format_bytes(n.fwd_out),
        format_bytes(n.bwd_tmp),
        format_bytes(n.bwd_out),
        human_flops(n.fwd_flops),
        human_flops(n.bwd_flops),
    )


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]
