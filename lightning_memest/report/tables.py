"""Per-module figures as plain rows and a text table (what ``memest profile --by module`` prints; the
per-node ones are ``GraphProfile.rows`` / ``GraphProfile.table``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, Final

from lightning_memest.constants import MODULE_ORDERS
from lightning_memest.report import ModuleStats, format_bytes, human_flops, render_columns

__all__ = ["MODULE_ORDERS", "module_rows", "module_table"]


_MODULE_SORT: Final[Mapping[str, Callable[[ModuleStats], int]]] = {
    "saved": lambda m: m.saved_bytes,
    "parameters": lambda m: m.parameter_bytes,
    "forward_peak": lambda m: m.forward_peak_bytes or 0,
    "backward_peak": lambda m: m.backward_peak_bytes or 0,
    "flops": lambda m: (m.forward_flops or 0) + (m.backward_flops or 0),
}


def module_rows(
    modules: ModuleStats, by: str = "tree", top: int | None = None, *, leaves_only: bool = False
) -> list[dict[str, Any]]:
    """The module-level counterpart of :meth:`GraphProfile.rows`: one dict per module of an estimate's
    tree (``estimate_step(...).modules``; figures of the first step, each module including its
    children), in tree order or sorted by a figure, largest first.

    Example:
        >>> import torch
        >>> from lightning_memest import estimate_step
        >>> est = estimate_step(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
        ...                     torch.randn(2, 4), steps=1)
        >>> [(r["path"], r["saved_bytes"]) for r in module_rows(est.modules, by="saved")]
        [('', 32), ('1', 32), ('0', 0)]
    """
    if by not in MODULE_ORDERS:
        raise ValueError(f"by must be one of {', '.join(MODULE_ORDERS)}; got {by!r}")
    if top is not None and top < 0:
        raise ValueError(f"top must be at least 0; got {top}")
    chosen = [m for m in modules.walk() if not leaves_only or not m.children]
    if by != "tree":
        chosen.sort(key=_MODULE_SORT[by], reverse=True)
    if top is not None:
        chosen = chosen[:top]
    return [{f.name: getattr(m, f.name) for f in fields(m) if f.name != "children"} for m in chosen]


def module_table(
    modules: ModuleStats, by: str = "tree", top: int | None = None, *, leaves_only: bool = False
) -> str:
    """:func:`module_rows` as a text table like :meth:`GraphProfile.table`.

    Example:
        >>> import torch
        >>> from lightning_memest import estimate_step
        >>> est = estimate_step(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
        ...                     torch.randn(2, 4), steps=1)
        >>> print(module_table(est.modules, by="saved", top=2))
        module  type        params  saved  fwd peak  bwd peak  fwd FLOPs  bwd FLOPs
        (root)  Sequential    80 B   32 B     176 B     232 B    64 FLOP    64 FLOP
        1       ReLU           0 B   32 B     176 B     184 B     0 FLOP     0 FLOP
    """
    rows = module_rows(modules, by, top, leaves_only=leaves_only)
    header = ("module", "type", "params", "saved", "fwd peak", "bwd peak", "fwd FLOPs", "bwd FLOPs")

    def maybe(value: int | None, render: Callable[[int], str]) -> str:
        return "-" if value is None else render(value)

    body = [
        (
            r["path"] or "(root)",
            r["type_name"],
            format_bytes(r["parameter_bytes"]),
            format_bytes(r["saved_bytes"]),
            maybe(r["forward_peak_bytes"], format_bytes),
            maybe(r["backward_peak_bytes"], format_bytes),
            maybe(r["forward_flops"], human_flops),
            maybe(r["backward_flops"], human_flops),
        )
        for r in rows
    ]
    return render_columns([header, *body], right_from=2)
