"""Activation checkpointing applied to a model, with torch's own wrappers: what a plan does to a model.

A planned module is wrapped in place by torch's ``checkpoint_wrapper`` (non-reentrant), its parent's
attribute pointing at the wrapper; the state dict's keys stay the same (the wrapper strips its prefix).
Two kinds:

* ``"full"`` -- nothing the module computes is kept for backward but its inputs; its forward runs again
  in backward.
* ``"selective"`` -- torch's selective checkpointing (``create_selective_checkpoint_contexts``) with a
  policy that saves the outputs of matrix products, convolutions and attention (:data:`SAVED_OPS`) and
  recomputes everything else (norms, activations, dropout, casts): less memory freed, almost no FLOPs
  again.

:func:`checkpointed` applies checkpointing for a ``with`` block and puts the model back after it (what
the planner simulates); :func:`apply_checkpointing` applies it for good. :class:`CheckpointPolicy` is
the callable Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)`` takes.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    >>> with checkpointed(model, {"1": "full"}):
    ...     type(model[1]).__name__
    'CheckpointWrapper'
    >>> type(model[1]).__name__, list(model.state_dict()) == ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]
    ('Sequential', True)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from lightning_memest.errors import MemestError

__all__ = [
    "KINDS",
    "SAVED_OPS",
    "CheckpointKind",
    "CheckpointPolicy",
    "apply_checkpointing",
    "checkpointed",
    "remove_checkpointing",
    "saved_by_selective",
    "wrap",
]

CheckpointKind = Literal["full", "selective"]
KINDS: tuple[CheckpointKind, ...] = ("full", "selective")

_aten = torch.ops.aten
#: What selective checkpointing keeps: the outputs of the ops that cost the FLOPs (matrix products,
#: convolutions, attention, as torchtitan's policy keeps), everything else recomputed.
SAVED_OPS: tuple[torch._ops.OpOverloadPacket, ...] = tuple(
    getattr(_aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, name)
)
_SAVED_NAMES = frozenset(str(packet) for packet in SAVED_OPS)


def saved_by_selective(op_name: str) -> bool:
    """Whether selective checkpointing keeps the outputs of the op named ``op_name``
    (``"aten.mm.default"``).

    >>> saved_by_selective("aten.mm.default"), saved_by_selective("aten.gelu.default")
    (True, False)
    """
    return op_name.rsplit(".", 1)[0] in _SAVED_NAMES


def _save_products(ctx: object, op: torch._ops.OpOverload, *args: object, **kwargs: object) -> object:
    from torch.utils.checkpoint import CheckpointPolicy as Policy

    return Policy.MUST_SAVE if op.overloadpacket in SAVED_OPS else Policy.PREFER_RECOMPUTE


def wrap(module: nn.Module, kind: CheckpointKind) -> nn.Module:
    """``module`` in torch's non-reentrant ``checkpoint_wrapper``, of ``kind``."""
    if kind == "full":
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if kind == "selective":
        context = functools.partial(create_selective_checkpoint_contexts, _save_products)
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context)
    raise ValueError(f"a checkpoint kind is 'full' or 'selective'; got {kind!r}")


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
        getattr(parent, name)
    except AttributeError:
        raise MemestError(f"the model has no module {path!r} to checkpoint") from None
    return parent, name


def apply_checkpointing(model: nn.Module, kinds: Mapping[str, CheckpointKind]) -> dict[str, nn.Module]:
    """Wrap each module ``path`` of ``model`` (qualified names) in checkpointing of its kind, in place;
    the modules replaced, by path (what :func:`checkpointed` puts back). A module already wrapped is
    left as it is."""
    replaced: dict[str, nn.Module] = {}
    for path, kind in kinds.items():
        parent, name = _parent(model, path)
        module = getattr(parent, name)
        if isinstance(module, CheckpointWrapper):
            continue
        setattr(parent, name, wrap(module, kind))
        replaced[path] = module
    return replaced


def remove_checkpointing(model: nn.Module, paths: Iterable[str]) -> dict[str, CheckpointKind]:
    """Unwrap the checkpointed modules at ``paths`` of ``model`` in place (the module torch's wrapper
    holds goes back to its parent: the same parameters, the same state-dict keys); the kinds they had,
    by path, for :func:`apply_checkpointing` to put back. A path not wrapped is left as it is.

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> _ = apply_checkpointing(model, {"1": "selective"})
    >>> remove_checkpointing(model, ["1"]), type(model[1]).__name__
    ({'1': 'selective'}, 'Linear')
    """
    removed: dict[str, CheckpointKind] = {}
    for path in paths:
        parent, name = _parent(model, path)
        module = getattr(parent, name)
        if isinstance(module, CheckpointWrapper):
            setattr(parent, name, module._checkpoint_wrapped_module)
            removed[path] = "selective" if _is_selective(module) else "full"
    return removed


def _is_selective(wrapper: CheckpointWrapper) -> bool:
    # wrap() gives selective checkpointing a context_fn; torch keeps it among the checkpoint kwargs.
    fn = getattr(wrapper, "checkpoint_fn", None)
    keywords = getattr(fn, "keywords", {}) if isinstance(fn, functools.partial) else {}
    return keywords.get("context_fn") is not None


@contextmanager
def checkpointed(model: nn.Module, kinds: Mapping[str, CheckpointKind]) -> Iterator[nn.Module]:
    """Inside the block, ``model`` with the modules ``kinds`` names checkpointed; afterwards exactly as
    it was (the same module objects in the same places)."""
    replaced = apply_checkpointing(model, kinds)
    try:
        yield model
    finally:
        for path, module in replaced.items():
            parent, name = _parent(model, path)
            setattr(parent, name, module)


class CheckpointPolicy:
    """``(module, recurse, nonwrapped_numel) -> bool``: the callable Lightning's
    ``FSDPStrategy(activation_checkpointing_policy=...)`` (and torch's ``apply_activation_checkpointing``
    as ``auto_wrap_policy``) takes, true for the planned modules of the model the plan was made for
    (matched by identity: the plan keeps weak references to them). It checkpoints in full: selective
    modules need :func:`apply_checkpointing`."""

    def __init__(self, model: nn.Module, paths: tuple[str, ...]) -> None:
        self.paths = paths
        self._modules = weakref.WeakSet(model.get_submodule(p) for p in paths)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int = 0) -> bool:
        return True if recurse else module in self._modules

    def __repr__(self) -> str:
        shown = ", ".join(self.paths[:3]) + (", ..." if len(self.paths) > 3 else "")
        return f"CheckpointPolicy({len(self.paths)} modules: {shown})"
