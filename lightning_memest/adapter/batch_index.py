"""The ``batch_idx`` a simulated step hands the module's code: the index of the batch it runs on, and a
note of whether the code read it.

The estimate at the first training batch simulates two steps on that one batch. Handing the second
``training_step(batch, 1)`` would show user code an index that has not come yet: a step that stops,
changes memory format or follows a schedule at ``batch_idx == 1`` would act early. So every simulated
step on a batch is given that batch's own index (:class:`WatchedIndex`), and where the code read it
(compared it, did arithmetic with it, used it as a key), the callback estimates again when the next
batch arrives, with its real index -- as it does when the step read a tensor's values.

Example:
    >>> reads = IndexReads()
    >>> i = WatchedIndex(0, reads)
    >>> reads.read, f"batch {i}", reads.read  # shown, not read
    (False, 'batch 0', False)
    >>> i % 2 == 0, reads.read
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["IndexReads", "WatchedIndex"]


class IndexReads:
    """Whether a simulated step's code read the ``batch_idx`` it was given."""

    def __init__(self) -> None:
        self.read = False


def _noting(name: str) -> Callable[..., Any]:
    method = getattr(int, name)

    def noted(self: WatchedIndex, *args: Any) -> Any:
        self._reads.read = True
        return method(self, *args)

    noted.__name__ = name
    return noted


class WatchedIndex(int):
    """An ``int`` (the batch's index) that notes in ``reads`` any use of its value but showing it
    (``str``, ``repr``, ``format``): comparisons, arithmetic, ``bool``, ``hash``, ``__index__``."""

    _reads: IndexReads

    def __new__(cls, value: int, reads: IndexReads) -> WatchedIndex:
        index = super().__new__(cls, value)
        index._reads = reads
        return index

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        return int, (int(self),)  # a copy (pickled, deep-copied) is a plain int


# Every value-reading method of int, noted (the results are plain ints: only the index itself is watched).
for _name in (
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__index__",
    "__int__", "__float__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__floordiv__", "__rfloordiv__", "__truediv__", "__rtruediv__", "__mod__", "__rmod__", "__divmod__",
    "__rdivmod__", "__pow__", "__rpow__", "__and__", "__rand__", "__or__", "__ror__", "__xor__",
    "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__neg__", "__pos__",
    "__abs__", "__invert__", "__round__", "__trunc__", "__floor__", "__ceil__",
):  # fmt: skip
    setattr(WatchedIndex, _name, _noting(_name))
