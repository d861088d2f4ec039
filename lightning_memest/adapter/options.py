"""``MemEstimate``'s options, checked when the callback is made: a typo or an impossible value is one
clear error then, not a silent default or a failure at the first batch.

Example:
    >>> check_options(max_depth=1, memory_check="warn", checkpointing="off", memory_budget="80%", margin_bytes=None,
    ...               flags={"check": True, "calibrate": True}, summarize_kwargs={})
    MemoryBudget(bytes=None, share=0.8)
    >>> check_options(max_depth=1, memory_check="warn", checkpointing="off", memory_budget=None, margin_bytes=None,
    ...               flags={}, summarize_kwargs={"memory_budjet": "1KiB"})
    Traceback (most recent call last):
    ...
    TypeError: MemEstimate() got an unexpected keyword argument 'memory_budjet'; its arguments are max_depth, check, calibrate, example_batch, memory_check, memory_budget, memory_margin_bytes, checkpointing, replay_blocks, header_style
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_memest.sizes import MemoryBudget

__all__ = ["ARGUMENTS", "SUMMARY_KEYWORDS", "check_options"]

#: The keywords Lightning's summaries take besides ``max_depth`` (``RichModelSummary``'s
#: ``header_style``; the plain summary takes none), passed on to the summary's table.
SUMMARY_KEYWORDS = ("header_style",)

#: ``MemEstimate``'s own arguments, in order, for the error that lists them.
ARGUMENTS = (
    "max_depth",
    "check",
    "calibrate",
    "example_batch",
    "memory_check",
    "memory_budget",
    "memory_margin_bytes",
    "checkpointing",
    "replay_blocks",
)

_CHECKS = ("off", "warn", "raise")


def check_options(
    *,
    max_depth: Any,
    memory_check: Any,
    checkpointing: Any,
    memory_budget: Any,
    margin_bytes: Any,
    flags: Mapping[str, Any],
    summarize_kwargs: Mapping[str, Any],
) -> MemoryBudget | None:
    """Check ``MemEstimate``'s arguments; the budget parsed (``None``: what the device has). A
    ``TypeError`` names an unknown keyword (with the valid ones) or a value of the wrong type, a
    ``ValueError`` a value out of range."""
    unknown = [name for name in summarize_kwargs if name not in SUMMARY_KEYWORDS]
    if unknown:
        raise TypeError(
            f"MemEstimate() got an unexpected keyword argument {unknown[0]!r}; its arguments are "
            f"{', '.join((*ARGUMENTS, *SUMMARY_KEYWORDS))}"
        )
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
        raise ValueError(
            f"max_depth must be an int of -1 (all layers), 0 (no summary) or more; got {max_depth!r}"
        )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False; got {value!r}")
    if memory_check not in _CHECKS:
        raise ValueError(f"memory_check must be 'off', 'warn' or 'raise'; got {memory_check!r}")
    if checkpointing not in ("off", "auto"):
        raise ValueError(f"checkpointing must be 'off' or 'auto'; got {checkpointing!r}")
    if margin_bytes is not None and (
        isinstance(margin_bytes, bool) or not isinstance(margin_bytes, int) or margin_bytes < 0
    ):
        raise ValueError(
            f"memory_margin_bytes must be a whole number of bytes, 0 or more; got {margin_bytes!r}"
        )
    if memory_budget is None:
        return None
    try:
        return MemoryBudget.parse(memory_budget)
    except (TypeError, ValueError) as e:
        raise type(e)(f"memory_budget: {e}") from None
