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

from lightning_memest.options import check_budget, check_choice, check_count, check_flag, check_int
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
    # max_depth as Lightning's ModelSummary takes it; the rest as every entry checks its options.
    if check_int("max_depth", max_depth) < -1:
        raise ValueError(
            f"max_depth must be an int of -1 (all layers), 0 (no summary) or more; got {max_depth!r}"
        )
    for name, value in flags.items():
        check_flag(name, value)
    check_choice("memory_check", memory_check, _CHECKS)
    check_choice("checkpointing", checkpointing, ("off", "auto"))
    if margin_bytes is not None:
        check_count("memory_margin_bytes", margin_bytes, minimum=0)
    return None if memory_budget is None else check_budget("memory_budget", memory_budget)
