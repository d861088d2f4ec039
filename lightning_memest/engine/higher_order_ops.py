"""Higher-order operators whose eager kernel is Python made of aten ops, run so on the simulation's
fake tensors.

Why: a higher-order operator (``torch._higher_order_ops``) dispatches on the current mode's *exact*
type, so a rule registered for ``FakeTensorMode`` does not serve its subclass ``TrackingFakeTensorMode``
("There was no rule registered for HigherOrderOperator flex_attention"). Where a real eager run's kernel
is a Python composite of aten ops -- ``flex_attention`` and its backward, outside ``torch.compile``, run
``sdpa_dense``/``sdpa_dense_backward`` (the scores materialised, on every device) -- the simulation runs
that same composite inside its mode, so each of its ops is allocated, saved and freed as in the real
run. :data:`COMPOSITES` names them; :func:`register_composites` is idempotent.

Example:
    >>> from torch._higher_order_ops.flex_attention import flex_attention
    >>> from lightning_memest.engine.tracking_mode import TrackingFakeTensorMode
    >>> TrackingFakeTensorMode in flex_attention.python_key_table
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch._C import DispatchKey
from torch._ops import HigherOrderOperator

__all__ = ["COMPOSITES", "register_composites"]

#: (module, operator) of the higher-order operators whose eager kernel is their
#: ``CompositeExplicitAutograd`` Python implementation.
COMPOSITES = (
    ("torch._higher_order_ops.flex_attention", "flex_attention"),
    ("torch._higher_order_ops.flex_attention", "flex_attention_backward"),
)


def register_composites(mode_type: type) -> None:
    """Register, for ``mode_type``, each of :data:`COMPOSITES`' eager composite, run inside the mode
    (skipped where torch has no such operator or composite; done once per operator)."""
    for module_name, name in COMPOSITES:
        try:
            hop = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
        if not isinstance(hop, HigherOrderOperator) or mode_type in hop.python_key_table:
            continue
        dense = hop.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
        if dense is not None:
            hop.py_impl(mode_type)(_inside_mode(dense))


def _inside_mode(dense: Callable[..., Any]) -> Callable[..., Any]:
    def rule(mode: Any, *args: Any, **kwargs: Any) -> Any:
        with mode:  # (the dispatcher popped it for the rule): the composite's ops are the step's
            return dense(*args, **kwargs)

    return rule
