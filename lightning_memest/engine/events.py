"""The event stream the engine emits while a step runs on fake tensors.

It is the single source of truth: accounting replays it into live bytes, peaks, breakdowns,
per-module figures and the timeline, so those can never disagree with each other.

Storages are named by an integer handle that is unique for the whole run (never reused, unlike
addresses).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memest.engine.step import Phase


class Role(str, enum.Enum):
    """What a storage holds; a storage takes the first role it is given (in this order of priority)."""

    PARAMETER = "parameters"
    BUFFER = "buffers"
    INPUT = "inputs"
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENT = "gradients"
    ACTIVATION = "activations"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a kernel model needs to know of a tensor argument (never its data)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    nbytes: int
    """Bytes of the tensor's storage as the fake run has it."""

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(
            tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, t.untyped_storage().nbytes()
        )

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class OpCall:
    """One call of an aten op as kernel models and FLOP formulas see it."""

    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    """Arguments, with every tensor (also inside lists) replaced by its ``TensorMeta``."""
    kwargs: dict[str, Any]
    outputs: tuple[TensorMeta | None, ...]
    """Flattened outputs (``torch.utils._pytree`` leaf order); ``None`` where a leaf is no tensor."""
    device_type: str


@dataclass(frozen=True, slots=True)
class OpEvent:
    """An aten op ran. Its outputs' ``Alloc`` events follow it."""

    index: int
    step: int
    phase: Phase
    module: str
    op: str
    call: OpCall | None
    """The full call, only for ops some accounting registry asked for (kept small otherwise)."""
    outputs: tuple[int, ...] | None
    """Storage handles of the flattened tensor outputs, in order, when ``call`` is recorded."""


@dataclass(frozen=True, slots=True)
class Alloc:
    """A storage came to life (``resident``: it existed before the run and is never freed by it)."""

    storage: int
    nbytes: int
    resident: bool = False


@dataclass(frozen=True, slots=True)
class Free:
    """The last reference to a storage died."""

    storage: int


@dataclass(frozen=True, slots=True)
class Resize:
    """A live storage changed size (``resize_`` / ``out=`` ops)."""

    storage: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Tag:
    """A storage was given a role; ``module`` is where autograd saved it (for activations)."""

    storage: int
    role: Role
    module: str


@dataclass(frozen=True, slots=True)
class ModuleEnter:
    """A module's forward or backward began (phase says which)."""

    path: str
    phase: Phase


@dataclass(frozen=True, slots=True)
class ModuleExit:
    path: str
    phase: Phase


@dataclass(frozen=True, slots=True)
class DataDependent:
    """A value of a fake tensor was read; the engine assumed ``assumed`` (see ``data_dependent``)."""

    op: str
    module: str
    assumed: str


Event = OpEvent | Alloc | Free | Resize | Tag | ModuleEnter | ModuleExit | DataDependent
