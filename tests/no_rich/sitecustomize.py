"""Put this directory on PYTHONPATH and Python starts as where ``rich`` is not installed: ``import rich``
and ``importlib.util.find_spec("rich")`` find nothing, and neither does ``importlib.metadata`` (what
Lightning reads to pick its summary). For the tests of what a user without rich sees
(``tests/test_summary.py``)."""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from importlib.metadata import Distribution, DistributionFinder
from types import ModuleType
from typing import Any

_PathFinder = importlib.machinery.PathFinder


def _is_rich(name: str) -> bool:
    return name == "rich" or name.startswith("rich.")


class _PathFinderWithoutRich:
    """The standard path finder (modules and distributions on sys.path), blind to rich."""

    @classmethod
    def find_spec(
        cls, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return None if _is_rich(fullname) else _PathFinder.find_spec(fullname, path, target)

    @classmethod
    def find_distributions(cls, context: Any = None) -> Iterator[Distribution]:
        context = context or DistributionFinder.Context()
        for dist in _PathFinder.find_distributions(context):
            if (dist.metadata["Name"] or "").lower() != "rich":
                yield dist

    @classmethod
    def invalidate_caches(cls) -> None:
        _PathFinder.invalidate_caches()


sys.meta_path[:] = [_PathFinderWithoutRich if f is _PathFinder else f for f in sys.meta_path]
