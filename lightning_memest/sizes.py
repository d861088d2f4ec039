"""Sizes and memory budgets as people write them, read without torch (the ``memest`` parser uses them).

* :func:`parse_size` -- bytes from ``"10GiB"``, ``"1.5GB"``, ``"8g"``;
* :class:`MemoryBudget` -- a budget given as bytes, a size, or a share of what the device has
  (``"80%"``), checked when it is given, not when it is first used.

Example:
    >>> parse_size("10GiB"), MemoryBudget.parse("80%").share, MemoryBudget.parse(4096).bytes
    (10737418240, 0.8, 4096)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["MAX_SIZE", "MemoryBudget", "SizeTooLarge", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
_SHARE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*%\s*")

#: The largest size taken: 8 EiB, the most a signed 64-bit byte count holds (no machine comes near).
MAX_SIZE = 2**63 - 1


class SizeTooLarge(ValueError):
    """A size past :data:`MAX_SIZE` (a caller with a lower limit of its own says that one instead)."""


def parse_size(text: str) -> int:
    """Bytes from a size: ``'12345'``, ``'512MiB'``, ``'1.5GB'``, ``'8g'``.

    Units, case-insensitive: ``B``; binary ``KiB MiB GiB TiB`` and their one-letter forms ``K M G T``
    (as in ``docker --memory 8g``); decimal ``KB MB GB TB``. Fractions round down to whole bytes; at
    least one byte, at most :data:`MAX_SIZE`.

    >>> parse_size("10GiB"), parse_size("1.5GB"), parse_size("8g"), parse_size("4096")
    (10737418240, 1500000000, 8589934592, 4096)
    >>> parse_size("ten gigs")
    Traceback (most recent call last):
    ...
    ValueError: a size is a number and an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, K, M, G, T) such as 10GiB or 1.5GB; got 'ten gigs'
    >>> parse_size("1e300TiB")
    Traceback (most recent call last):
    ...
    lightning_memest.sizes.SizeTooLarge: a size must be at most 8 EiB (9223372036854775807 bytes); got '1e300TiB'
    """  # noqa: E501
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            "a size is a number and an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, K, M, G, T) "
            f"such as 10GiB or 1.5GB; got {_shown(text)}"
        )
    number = match.group(1)
    # Whole numbers exactly (a float of 2**63 - 1 rounds up past it); others through a float.
    value: float = int(number) * _UNITS[unit] if number.isdigit() else float(number) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_SIZE:
        raise SizeTooLarge(f"a size must be at most 8 EiB ({MAX_SIZE} bytes); got {_shown(text)}")
    if value < 1:
        raise ValueError(f"a size must be at least one byte; got {_shown(text)}")
    return int(value)


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:57] + "...")


@dataclass(frozen=True)
class MemoryBudget:
    """A memory budget: ``bytes``, or a ``share`` (0 < share <= 1) of what the device has -- the
    budget ``budget.device_budget`` finds, which already leaves the device's margins out."""

    bytes: int | None = None
    share: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.share is None):
            raise ValueError("a memory budget is bytes or a share of the device's memory, one of the two")
        if self.bytes is not None and not 1 <= self.bytes <= MAX_SIZE:
            raise ValueError(f"a memory budget must be 1 to {MAX_SIZE} bytes; got {self.bytes}")
        if self.share is not None and not 0 < self.share <= 1:
            raise ValueError(
                f"a memory budget's share must be more than 0 % and at most 100 %; got {self.share}"
            )

    @staticmethod
    def parse(value: int | str | MemoryBudget) -> MemoryBudget:
        """A budget from bytes (an ``int``), a size (``"10GiB"``, see :func:`parse_size`) or a share of
        the device's memory (``"80%"``); a ``ValueError`` (``TypeError`` for another type) that names
        the value otherwise.

        >>> MemoryBudget.parse("10GiB").bytes, MemoryBudget.parse("12.5%").share
        (10737418240, 0.125)
        >>> MemoryBudget.parse(-1)
        Traceback (most recent call last):
        ...
        ValueError: a memory budget must be 1 to 9223372036854775807 bytes; got -1
        >>> MemoryBudget.parse("150%")
        Traceback (most recent call last):
        ...
        ValueError: a memory budget's share must be more than 0 % and at most 100 %; got '150%'
        """
        if isinstance(value, MemoryBudget):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(
                "a memory budget is bytes (int), a size ('10GiB') or a share ('80%'); got "
                f"{type(value).__name__}"
            )
        if isinstance(value, int):
            return MemoryBudget(bytes=value)
        share = _SHARE.fullmatch(value)
        if share is None:
            return MemoryBudget(bytes=parse_size(value))
        fraction = float(share.group(1)) / 100
        if not 0 < fraction <= 1:
            raise ValueError(
                f"a memory budget's share must be more than 0 % and at most 100 %; got {_shown(value)}"
            )
        return MemoryBudget(share=fraction)

    def of(self, device_bytes: int) -> int:
        """The budget in bytes, where the device has ``device_bytes`` for a step.

        >>> MemoryBudget(share=0.5).of(1000), MemoryBudget(bytes=64).of(1000)
        (500, 64)
        """
        if self.bytes is not None:
            return self.bytes
        assert self.share is not None
        return int(device_bytes * self.share)

    def __str__(self) -> str:
        return f"{self.bytes:,} B" if self.bytes is not None else f"{100 * (self.share or 0):g} %"
