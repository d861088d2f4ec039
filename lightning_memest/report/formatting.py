"""How the reports write numbers: bytes in binary units, FLOPs in decimal ones, shares, and text columns."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_bytes", "format_share", "human_flops", "render_columns"]


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``'1.50 KiB'``; binary units, as memory is sized."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_flops(n: int | float) -> str:
    """``1.8e9`` -> ``'1.80 GFLOP'``; decimal units, as FLOPs are counted."""
    value = float(n)
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(value) < 1000 or unit == "P":
            return f"{int(value)} FLOP" if not unit else f"{value:.2f} {unit}FLOP"
        value /= 1000
    raise AssertionError("unreachable")


def format_share(share: float) -> str:
    """A share as a percentage: ``0.189`` -> ``'18.9 %'``; a small one keeps two figures, so that it
    does not read as nothing (``0.00042`` -> ``'0.042 %'``)."""
    value = 100 * share
    return f"{value:.1f} %" if abs(value) >= 1 or value == 0 else f"{value:.2g} %"


def render_columns(rows: Sequence[Sequence[str]], right_from: int) -> str:
    """Columns two spaces apart; those from ``right_from`` on right-aligned, except in the header.

    >>> print(render_columns([("a", "b"), ("x", "12"), ("yy", "3")], right_from=1))
    a   b
    x   12
    yy   3
    """
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [
            c.rjust(w) if i >= right_from and k > 0 else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
