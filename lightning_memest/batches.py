"""Batches of any structure: their tensors, their batch size, and resized copies on the meta device.

One walker serves the package: a batch is a tensor or any nesting of tuples, lists, dicts (and other
mappings), named tuples and dataclasses of them, as Lightning moves batches to their device
(``lightning_utilities``' ``apply_to_collection``); other values are left as they are.

Example:
    >>> import torch
    >>> batch = {"x": torch.zeros(4, 3), "y": (torch.zeros(4), "label")}
    >>> [tuple(t.shape) for t in iter_tensors(batch)], batch_size_of(batch)
    ([(4, 3), (4,)], 4)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_memest.errors import MemestError

__all__ = ["batch_size_of", "graph_data", "iter_tensors", "map_tensors", "resize_batch"]


def graph_data(value: Any) -> bool:
    """Whether ``value`` is a graph library's batch object (torch_geometric's ``Data``, ``HeteroData``,
    ``Batch``): tensors in stores behind attributes, listed by ``to_dict()``, mapped by ``apply``. Duck
    typed, so that no graph library is imported."""
    kind = type(value)
    return all(callable(getattr(kind, name, None)) for name in ("apply", "to_dict")) and hasattr(
        value, "stores"
    )


def _graph_types(batch: Any) -> tuple[type, ...]:
    """The types of the graph-data objects anywhere in ``batch`` (usually none)."""
    found: dict[type, None] = {}
    stack = [batch]
    while stack:
        value = stack.pop()
        if graph_data(value):
            found[type(value)] = None
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            stack.extend(getattr(value, f.name) for f in dataclasses.fields(value))
    return tuple(found)


def map_tensors(batch: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``batch`` rebuilt with ``fn(t)`` in place of every tensor ``t`` (a graph batch object is copied
    and its copy's tensors mapped; the original is left as it is).

    >>> map_tensors((torch.ones(2), [torch.zeros(1)], 3), lambda t: t.shape[0])
    (2, [1], 3)
    """
    graphs = _graph_types(batch)
    if not graphs:
        return apply_to_collection(batch, Tensor, fn)

    def mapped(value: Any) -> Any:
        if isinstance(value, Tensor):
            return fn(value)
        return copy.copy(value).apply(fn)

    return apply_to_collection(batch, (Tensor, *graphs), mapped)


def iter_tensors(batch: Any) -> Iterator[Tensor]:
    """Every tensor in ``batch``, in order (in sets too: callers pass collections of resident tensors).

    >>> len(list(iter_tensors([torch.ones(1), {"a": torch.ones(2), "b": {torch.ones(3).sum()}}])))
    3
    """
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from iter_tensors(value)
    elif isinstance(batch, (Sequence, set, frozenset)) and not isinstance(batch, (str, bytes)):
        for value in batch:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from iter_tensors(getattr(batch, f.name))
    elif graph_data(batch):
        yield from iter_tensors(batch.to_dict())


def batch_size_of(batch: Any) -> int:
    """The batch size of ``batch``: the leading size of its first tensor with one.

    >>> batch_size_of({"x": torch.zeros(4, 3), "y": (torch.zeros(4),)})
    4
    """
    if graph_data(batch) and isinstance(getattr(batch, "num_graphs", None), int):
        return int(batch.num_graphs)  # a batch of graphs: its graphs, not its nodes
    sizes = [t.shape[0] for t in iter_tensors(batch) if t.ndim]
    if not sizes:
        raise MemestError("the batch holds no tensor with a batch dimension, so it cannot be resized")
    return sizes[0]


def resize_batch(batch: Any, old: int, new: int) -> Any:
    """``batch`` with each tensor of leading size ``old`` replaced by a meta tensor of leading size ``new``.

    Meta tensors have shapes and dtypes but no memory, so a batch of any size costs nothing; the
    estimator accepts them. Other tensors and values are kept as they are. Nested tuples, lists, dicts,
    named tuples and dataclasses are rebuilt (``lightning_utilities``' ``apply_to_collection``).

    A tensor whose leading size equals ``old`` by coincidence (a sequence length equal to the batch
    size) is resized too; choose a probe batch size that no other leading dimension shares.

    >>> x, y = resize_batch((torch.zeros(8, 3, 32, 32), torch.zeros(8, dtype=torch.long)), 8, 1000)
    >>> x.shape, x.device, y.dtype
    (torch.Size([1000, 3, 32, 32]), device(type='meta'), torch.int64)
    """

    if _graph_types(batch):
        raise MemestError(
            "a batch of graphs cannot be resized by its leading sizes (nodes and edges vary per graph): "
            "estimate the batch in hand, or give the largest batch to expect (example_batch=)"
        )

    def resize(t: Tensor) -> Tensor:
        if t.ndim == 0 or t.shape[0] != old:
            return t
        shape = (new, *t.shape[1:])
        # Keep channels-last inputs channels-last: convolution kernels (and their memory) depend on it.
        channels_last = (
            t.ndim == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
        )
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        return torch.empty(shape, dtype=t.dtype, device="meta", memory_format=fmt)

    return map_tensors(batch, resize)
