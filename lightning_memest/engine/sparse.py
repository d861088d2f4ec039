"""Sparse COO tensors on fake tensors: how many entries a sparse tensor holds, as a real run has it.

A sparse COO tensor's memory is its parts: ``indices`` (``sparse_dim`` x nnz, int64) and ``values``
(nnz x the dense dims). ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` make their
weight's gradient one (nnz: one entry per looked-up id), and sparse optimizers (``SparseAdam``, sparse
``SGD``/``Adagrad``) work on it part by part. The fake mode builds such tensors right from their parts
(``_sparse_coo_tensor_with_dims_and_tensors``), but its kernels of the ops that copy or reduce one make
an empty sparse tensor (nnz 0, measured on torch 2.14.1): ``clone`` (autograd's first gradient is a
clone), ``_coalesce`` (how many distinct indices: a value the fake run does not have), ``add`` of two
sparse tensors (accumulated gradients). Everything after them -- the optimizer's ``sparse_mask`` and
its arithmetic on the values -- then works on nothing: the estimate missed what the sparse gradient and
the optimizer's update hold.

:data:`SPARSE_RULES` gives each such op its output from its inputs' parts, as the real kernel does:

* ``clone`` copies both parts -- but not where autograd makes a parameter's first gradient
  (``AccumulateGrad``, a clone in backward): that takes the new gradient's parts as they are where both
  are contiguous (accumulate_grad.h: the parts' use counts are 1 in a real run; a fake tensor's Python
  object holds one more, so the fake run always clones). ``nn.EmbeddingBag``'s gradient is kept so,
  ``nn.Embedding``'s values are an expanded view of the output's gradient and are copied;
* ``add``/``sub`` of two sparse tensors concatenate them (left
  uncoalesced); ``sparse_mask`` makes new values and a copy of the mask's indices, and a temporary of
  the values' size while it runs;
* ``_coalesce`` keeps one entry per distinct index: counted exactly where the indices are known (the
  batch's ids, as ``engine.real_path`` knows them: a sparse tensor built from known indices keeps them,
  and ``clone``/``add``/``_coalesce`` carry them), the input's nnz (every index distinct: the most it
  can hold) otherwise, which the report lists as an assumed read. Its parts' storages are the input's
  size whatever it keeps (narrowed views), and its sort needs ``(sparse_dim + 2) * nnz`` int64s while
  it runs.

Each measured with the CPU allocator's events (torch 2.14.1, sparse_dim 1 and 2); rules return what
their kernel allocates beyond its outputs while it runs (the op's workspace, as ``engine.real_ops``).

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> mode = FakeTensorMode()
    >>> with mode:
    ...     g = torch.sparse_coo_tensor(torch.zeros(1, 5, dtype=torch.long), torch.ones(5, 3), (10, 3))
    ...     plain = g.clone()._nnz()
    >>> def note(what, exact): pass
    >>> with mode:
    ...     kept, workspace = SPARSE_RULES.lookup(torch.ops.aten.clone.default)(torch.ops.aten.clone.default, (g,), {}, note, False)
    >>> plain, kept._nnz()
    (0, 5)
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_memest.registry import OpRegistry

__all__ = ["SPARSE_RULES", "Note", "carry_indices", "sparse_rule"]

aten = torch.ops.aten

#: Says what a rule answered for a value it needed: ``(what, exact)`` (the report's value reads).
Note = Callable[[str, bool], None]
#: A rule: ``(op, args, kwargs, note, backward) -> (output, workspace bytes)``, made from the sparse
#: inputs' parts; ``backward``: whether autograd's backward runs the op.
SparseRule = Callable[[torch._ops.OpOverload, Sequence[Any], Mapping[str, Any], Note, bool], tuple[Any, int]]

SPARSE_RULES: OpRegistry[SparseRule] = OpRegistry("sparse rules")

#: The attribute of a sparse fake tensor that holds its known indices (a real CPU tensor).
_INDICES = "_memest_sparse_indices"


def sparse_rule(func: torch._ops.OpOverload, args: Sequence[Any]) -> SparseRule | None:
    """The rule for ``func`` where a sparse COO tensor is among its positional arguments."""
    rule = SPARSE_RULES.lookup(func)
    if rule is None or not any(isinstance(a, Tensor) and a.layout == torch.sparse_coo for a in args):
        return None
    return rule


#: Ops whose sparse output's indices are the values of one of their arguments: which one.
_INDICES_FROM = {
    aten._sparse_coo_tensor_with_dims_and_tensors.default: 3,  # (sparse_dim, dense_dim, size, indices, ...)
    # nn.EmbeddingBag(sparse=True)'s gradient: its ids, one row each (embedding_sparse_backward)
    aten._embedding_bag_backward.default: 1,
}


def carry_indices(func: Any, args: Sequence[Any], out: Any, read: Callable[[Tensor], Tensor | None]) -> None:
    """A sparse tensor made from indices whose values the simulation knows (``read``) keeps them, for
    a later ``_coalesce`` to count (:data:`_INDICES_FROM`: the ops that make one)."""
    position = _INDICES_FROM.get(func)
    if position is None or not (isinstance(out, Tensor) and out.layout == torch.sparse_coo):
        return
    indices = args[position]
    value = read(indices) if isinstance(indices, Tensor) else None
    if value is not None and value.numel() == out.sparse_dim() * out._nnz():
        setattr(out, _INDICES, value.reshape(out.sparse_dim(), -1))


def _known(t: Tensor) -> Tensor | None:
    value = t.__dict__.get(_INDICES)
    return value if isinstance(value, Tensor) else None


def _build(like: Tensor, indices: Tensor, values: Tensor, coalesced: bool, known: Tensor | None) -> Tensor:
    out: Tensor = aten._sparse_coo_tensor_with_dims_and_tensors.default(
        like.sparse_dim(),
        like.dense_dim(),
        list(like.shape),
        indices,
        values,
        dtype=values.dtype,
        layout=torch.sparse_coo,
        device=values.device,
        is_coalesced=coalesced,
    )
    if known is not None:
        setattr(out, _INDICES, known)
    return out


@SPARSE_RULES.register(aten.clone.default)
def _clone(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], note: Note, backward: bool
) -> tuple[Tensor, int]:
    # Both parts copied (SparseTensor.cpp's clone_sparse: copy_sparse_ of indices and values); in
    # backward, AccumulateGrad's shallow copy where the parts are contiguous (see the module docstring).
    t = args[0]
    indices, values = t._indices(), t._values()
    if not (backward and indices.is_contiguous() and values.is_contiguous()):
        indices, values = indices.clone(), values.clone()
    return _build(t, indices, values, t.is_coalesced(), _known(t)), 0


@SPARSE_RULES.register(aten._coalesce.default)
def _coalesce(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], note: Note, backward: bool
) -> tuple[Tensor, int]:
    # One entry per distinct index: known indices say how many; else every index distinct (the most).
    t = args[0]
    indices, values = t._indices(), t._values()
    nnz = indices.shape[1]
    known = _known(t)
    coalesced: Tensor | None = None
    if known is not None and known.shape == indices.shape:
        coalesced = torch.unique(known, dim=1) if nnz else known
        note(f"{coalesced.shape[1]} distinct indices of {nnz} (the batch's)", True)
    else:
        note(f"all {nnz} indices distinct", False)
    kept = nnz if coalesced is None else coalesced.shape[1]
    new_indices = indices.new_empty((indices.shape[0], nnz))[:, :kept]
    new_values = values.new_empty((nnz, *values.shape[1:]))[:kept]
    return _build(t, new_indices, new_values, True, coalesced), (indices.shape[0] + 2) * nnz * 8


@SPARSE_RULES.register(aten.add.Tensor, aten.sub.Tensor)
def _add(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], note: Note, backward: bool
) -> tuple[Any, int]:
    # sparse + sparse: both parts concatenated, left uncoalesced (add_out_sparse_contiguous); a dense
    # operand gives a dense result, which the fake kernel gets right.
    a, b = args[0], args[1]
    if not (isinstance(b, Tensor) and a.layout == torch.sparse_coo and b.layout == torch.sparse_coo):
        return func(*args, **kwargs), 0
    indices = torch.cat([a._indices(), b._indices()], 1)
    values = torch.cat([a._values(), b._values()], 0)
    ka, kb = _known(a), _known(b)
    known = torch.cat([ka, kb], 1) if ka is not None and kb is not None else None
    return _build(a, indices, values, False, known), 0


@SPARSE_RULES.register(aten.sparse_mask.default)
def _sparse_mask(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], note: Note, backward: bool
) -> tuple[Tensor, int]:
    # The dense tensor's entries at the mask's indices: the mask's nnz, new values and indices.
    dense, mask = args[0], args[1]
    indices = mask._indices()
    values = dense.new_empty((indices.shape[1], *dense.shape[mask.sparse_dim() :]))
    out = _build(mask, indices.clone(), values, mask.is_coalesced(), _known(mask))
    return out, values.numel() * values.element_size() + 4  # (a values-sized product, and a scalar)
