"""``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``), read as ``c10/cuda/CUDAAllocatorConfig.cpp``
parses it: the settings of the caching allocator model (``accounting/cuda_allocator.py``).

Example:
    >>> parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")
    AllocConf(expandable_segments=True, max_split_size=134217728, max_non_split_rounding_size=20971520, roundup_power2_divisions=0)
"""  # noqa: E501

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["ROUNDUP_INTERVALS", "AllocConf", "environment_alloc_conf", "parse_alloc_conf"]

#: AllocatorConfig's kRoundUpPowerOfTwoIntervals.
ROUNDUP_INTERVALS = 16
_MIB = 1_048_576
_LARGE_BUFFER = 20_971_520  # kLargeBuffer: max_non_split_rounding_mb's default


@dataclass(frozen=True)
class AllocConf:
    """The allocator settings the model follows (``None``/defaults where the variable does not say)."""

    expandable_segments: bool = False
    max_split_size: int | None = None
    max_non_split_rounding_size: int = _LARGE_BUFFER
    roundup_power2_divisions: int | tuple[int, ...] = 0


def environment_alloc_conf() -> str:
    """This process's setting: ``PYTORCH_CUDA_ALLOC_CONF``, else ``PYTORCH_ALLOC_CONF``, else ``""``."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""


def parse_alloc_conf(conf: str) -> AllocConf:
    """Read ``expandable_segments``, ``max_split_size_mb``, ``max_non_split_rounding_mb`` and
    ``roundup_power2_divisions`` (a number, or the ``[256:1,512:2,>:4]`` form, as ``parseArgs`` does);
    other keys are skipped, as the real parser skips keys it does not know."""
    expandable = False
    max_split: int | None = None
    rounding = _LARGE_BUFFER
    divisions: int | tuple[int, ...] = 0
    for key, value in re.findall(r"(\w+)\s*:\s*(\[[^\]]*\]|[^,]+)", conf):
        value = value.strip()
        if key == "expandable_segments":
            expandable = value.lower() == "true"
        elif key == "max_split_size_mb":
            max_split = int(value) * _MIB
        elif key == "max_non_split_rounding_mb":
            rounding = int(value) * _MIB
        elif key == "roundup_power2_divisions":
            divisions = _parse_divisions(value)
    return AllocConf(expandable, max_split, rounding, divisions)


def _parse_divisions(value: str) -> int | tuple[int, ...]:
    """``parseRoundUpPower2Divisions``: a number, or ``[boundary_mb:divisions, ..., >:divisions]``."""
    if not value.startswith("["):
        return int(value)
    table = [0] * ROUNDUP_INTERVALS
    first_value = True
    last_index = 0
    for entry in value.strip("[]").split(","):
        boundary, _, div = entry.partition(":")
        boundary, d = boundary.strip(), int(div)
        if boundary == ">":
            table[last_index + 1 :] = [d] * (ROUNDUP_INTERVALS - last_index - 1)
            continue
        b = int(boundary)
        if b <= 0 or b & (b - 1):
            raise ValueError(f"roundup_power2_divisions: the intervals have to be powers of 2, got {b}")
        index = min(b.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first_value:
            table[:index] = [d] * index
            first_value = False
        table[index] = d
        last_index = index
    return tuple(table)
