"""The event stream the engine emits while a step runs on fake tensors.

It is the single source of truth: accounting replays it into live bytes, peaks, breakdowns,
per-module figures and the timeline, so those can never disagree with each other.

Storages are named by an integer handle that is unique for the whole run (never reused, unlike
addresses).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "NO_OP",
    "Alloc",
    "DataDependent",
    "Event",
    "Free",
    "Mark",
    "ModuleEnter",
    "ModuleExit",
    "OpCall",
    "OpEvent",
    "Phase",
    "PhaseStart",
    "Resize",
    "Role",
    "Tag",
    "TensorMeta",
]


class Phase(str, enum.Enum):
    """Where in the training step an op runs."""

    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    ZERO_GRAD = "zero_grad"


class Role(str, enum.Enum):
    """What a storage holds; a storage takes the first role it is given (in this order of priority)."""

    PARAMETER = "parameters"
    BUFFER = "buffers"
    INPUT = "inputs"
    OTHER = "other_tensors"
    """Tensors alive on the device that are not the step's own: other callbacks' state (an EMA copy of
    the weights), metric states, a dataset held in memory."""
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENT = "gradients"
    COMMUNICATION = "communication"
    """Data parallelism's own storages: DDP's gradient buckets, FSDP's unsharded parameters and its
    all-gather / reduce-scatter buffers."""
    ACTIVATION = "activations"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a kernel model or FLOP formula may know of a tensor: geometry, dtype, device, storage size."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    nbytes: int  # of the tensor's storage, as the fake run has it

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        if t.is_nested:  # no one shape: described as its packed elements
            return TensorMeta((t.numel(),), (1,), t.dtype, t.device.type, t.untyped_storage().nbytes())
        if t.layout is not torch.strided:  # sparse: no strides, its bytes in its compressed parts
            from lightning_memest.engine.tracker import storages_of

            nbytes = sum(s.nbytes() for s in storages_of(t))
            return TensorMeta(tuple(t.shape), (), t.dtype, t.device.type, nbytes)
        return TensorMeta(
            tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, t.untyped_storage().nbytes()
        )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def strided(self) -> bool:
        """Whether a strided tensor (not sparse: no strides, its bytes in its parts)."""
        return len(self.stride) == len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def bytes(self) -> int:
        """Bytes of the elements themselves (what a contiguous copy allocates)."""
        return self.numel * self.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def is_channels_last(self) -> bool:
        """Strides of a channels-last 4-d tensor that is not also plain contiguous (as PyTorch decides)."""
        if len(self.shape) != 4 or self.is_contiguous():
            return False
        _, c, h, w = self.shape
        s = self.stride
        return s[1] == 1 and (w == 1 or s[3] == c) and (h == 1 or s[2] == c * w)


@dataclass(frozen=True, slots=True)
class OpCall:
    """One op call as the fake run saw it, for kernel models and FLOP formulas; tensors are replaced by
    :class:`TensorMeta` (in lists too)."""

    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[TensorMeta | None, ...]  # flattened outputs, None for non-tensors
    device_type: str  # "cpu" / "cuda"
    grad_enabled: bool = True
    """Whether grad mode was on (forward: usually; backward and optimizer: off). Some kernels allocate
    by it: oneDNN's LSTM makes its workspace only with grad mode on."""
    context: tuple[tuple[str, Any], ...] = ()
    """What the step's code had set when it called the op that the op's arguments do not say (the SDP
    backends a CUDA what-if's attention may use: ``engine.cuda_paths``)."""

    def noted(self, name: str, default: Any = None) -> Any:
        """The value of ``name`` in :attr:`context`, or ``default``."""
        return next((value for key, value in self.context if key == name), default)

    @property
    def strided(self) -> bool:
        """Whether every tensor the call takes or makes is strided (a real stand-in can be made)."""
        args = (*self.args, *self.kwargs.values())
        metas = [m for a in args for m in (a if isinstance(a, (list, tuple)) else (a,))]
        metas += self.outputs
        return all(m.strided for m in metas if isinstance(m, TensorMeta))

    def arg(self, name: str, default: Any = None) -> Any:
        """The argument called ``name`` in the op's schema: positional, keyword, or its default."""
        for index, argument in enumerate(self.op._schema.arguments):
            if argument.name != name:
                continue
            if index < len(self.args) and not argument.kwarg_only:
                return self.args[index]
            if name in self.kwargs:
                return self.kwargs[name]
            return argument.default_value if argument.has_default_value() else default
        return default


# Every event class is slotted, compared and hashed by value like a frozen dataclass, but not frozen:
# a frozen dataclass's constructor sets each field through object.__setattr__ (an OpEvent 0.85 us
# against 0.15 us), and a simulation makes tens of thousands of events (a replayed layer some 500 a
# step). Nothing changes an event once made.


#: The op name of the event that stands for a step that ran no op at all (a ``training_step`` that
#: returned ``None`` at once): at the step's start, so that the step has a peak -- what was live then.
NO_OP = "(no op)"


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
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
    numel: int = 0
    """Elements of the op's first tensor output (0 when it returns none); recorded for every op, so that
    per-element work (pointwise FLOPs) is known without capturing the call."""
    workspace: int = 0
    """Bytes the op's kernel allocated beyond its outputs, measured, where it ran for real
    (``engine.real_ops``: its fake kernel failed); 0 otherwise (kernel models say)."""


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
class Alloc:
    """A storage came to life (``resident``: it existed before the run and is never freed by it)."""

    storage: int
    nbytes: int
    resident: bool = False


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
class Free:
    """The last reference to a storage died."""

    storage: int


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
class Resize:
    """A live storage changed size (``resize_`` / ``out=`` ops)."""

    storage: int
    nbytes: int


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
class Tag:
    """A storage was given a role; ``module`` is where autograd saved it (for activations)."""

    storage: int
    role: Role
    module: str


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
class ModuleEnter:
    """A module's forward or backward began (phase says which)."""

    path: str
    phase: Phase


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
class ModuleExit:
    path: str
    phase: Phase
    outputs: tuple[int, ...] = ()
    """At a forward's end: the storage handles of the tensors the module returned (what stays alive
    for its callers whatever the module keeps for its own backward)."""


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
class DataDependent:
    """A value of a fake tensor was read; the engine answered ``assumed`` (see ``data_dependent``):
    the real value where ``exact`` (a value the simulation knows, or the only one possible); else an
    upper bound of the real one where ``bound``, or an answer the real values could exceed."""

    op: str
    module: str
    assumed: str
    exact: bool = False
    bound: bool = False


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
class Mark:
    """A caller's label for the events that follow, until the next mark: the fx profile marks which graph
    node runs (``owner``, its index; -1 outside the graph) and whether in its backward."""

    owner: int
    backward: bool


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see the note before OpEvent
class PhaseStart:
    """Step ``step`` (0-based) enters ``phase``: where the previous phase ended, ops or none (a
    ``zero_grad(set_to_none=True)`` runs no op but frees the gradients)."""

    step: int
    phase: Phase


Event = OpEvent | Alloc | Free | Resize | Tag | ModuleEnter | ModuleExit | DataDependent | Mark | PhaseStart
