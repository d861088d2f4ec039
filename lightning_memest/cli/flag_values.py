"""What a ``memest`` flag's value may be: each number, size and shape is checked as it is parsed, so a
bad one is a usage error (exit 2) before any model is built. Torch-free, as the whole parser.

Each has an upper bound too: a number past what torch can hold (2**63) failed deep inside it, as an
unexpected error.

Example:
    >>> DIM("8"), byte_size("1KiB"), capability("9.0")
    (8, 1024, (9, 0))
    >>> DIM("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be at least 1; got 0
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from lightning_memest.sizes import SizeTooLarge, parse_size

__all__ = [
    "DIM",
    "MAX_BUCKET_MB",
    "MAX_CAPABILITY",
    "MAX_DIM",
    "MAX_ROWS",
    "MAX_SIZE",
    "MAX_WORLD_SIZE",
    "byte_size",
    "capability",
    "positive_number",
    "shape_text",
    "shown",
    "whole",
]

#: One dimension of a tensor (--batch-size, --max-batch-size, --tokens, --vocab, each size of
#: --input-shape): the largest int32, what many kernels' 32-bit indexing allows. Far beyond any real step,
#: yet an estimate beyond the machine still answers (its batch is never made: a test runs 10**7).
MAX_DIM = 2**31 - 1
#: Ranks (--world-size): beyond the shard groups of the largest jobs. The fake process group's work grows
#: with them (FSDP at 65,536 ranks: about 100 s for a two-layer MLP).
MAX_WORLD_SIZE = 2**16
#: Rows shown (--top): more than any profile has.
MAX_ROWS = 2**31 - 1
#: DDP's bucket (--bucket-cap-mb): 1 TiB, more than any model's gradients (1e308 overflowed DDP's bytes).
MAX_BUCKET_MB = 2.0**20
#: Memory sizes (--memory-budget, --gpu-memory): 1024 TiB (2**60 bytes), beyond any machine.
MAX_SIZE = 2**60
#: MAJOR and MINOR of --cuda-capability (GPUs so far: up to 12.x).
MAX_CAPABILITY = 99


def shown(text: str) -> str:
    """``text`` for an error message: a pasted megabyte of digits is not repeated in full."""
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"


def whole(minimum: int, maximum: int, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also past Python's 4300 digits
            raise argparse.ArgumentTypeError(f"invalid int value: {shown(text)}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}; got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}{why}; got {shown(text.strip())}")
        return value

    return parse


def positive_number(maximum: float, why: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {shown(text)}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a number more than 0; got {shown(text)}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:.15g}{why}; got {shown(text)}")
        return value

    return parse


def byte_size(text: str) -> int:
    try:
        value = parse_size(text)
    except SizeTooLarge:
        value = MAX_SIZE + 1  # too large for any machine: said with the flag's own limit below
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most 1024TiB ({MAX_SIZE} bytes); got {shown(text)}")
    return value


def capability(text: str) -> tuple[int, int]:
    major, dot, minor = text.partition(".")
    if not (dot and major.isascii() and major.isdigit() and minor.isascii() and minor.isdigit()):
        raise argparse.ArgumentTypeError(f"must look like 9.0 (MAJOR.MINOR); got {shown(text)}")
    if int(major) > MAX_CAPABILITY or int(minor) > MAX_CAPABILITY:
        raise argparse.ArgumentTypeError(
            f"MAJOR and MINOR must be at most {MAX_CAPABILITY} (like 9.0); got {shown(text)}"
        )
    return int(major), int(minor)


def shape_text(text: str) -> str:
    """``--input-shape``: each size bounded as a dimension (``cases.parse_shape`` reads the rest)."""
    for part in text.split(","):
        try:
            size = int(part)
        except ValueError:
            continue  # not a number: settings() says what a shape looks like
        if size > MAX_DIM:
            raise argparse.ArgumentTypeError(
                f"each size must be at most {MAX_DIM} (2**31-1, a tensor dimension); "
                f"got {shown(part.strip())}"
            )
    return text


DIM = whole(1, MAX_DIM, " (2**31-1, a tensor dimension)")
