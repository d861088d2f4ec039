"""What a kernel memory model says, and the registries that hold the models, one per kind of run.

A fake-tensor run sees each op's outputs and nothing else. Real kernels also allocate *workspaces*
(held only while the op runs) and some return outputs bigger than their meta kernels say. A kernel
model computes that from the op's argument metadata alone (an :class:`~lightning_memest.engine.events.OpCall`)
and answers with a :class:`KernelMemory`.

Semantics of :class:`KernelMemory`: while the op runs, the allocator holds what it held before the op,
plus the op's outputs, plus ``workspace_bytes`` (when ``workspace_after_outputs``); when
``workspace_after_outputs`` is false the workspace is held and released *before* the outputs exist
(peak ``before + max(workspace, outputs)``). Models report the op's *excess*: the most it holds at once
beyond what existed before plus its outputs, so most use ``workspace_after_outputs=True`` even where
the kernel frees part of it before allocating an output -- the peak is the same.

The registries (which one applies is the policy of ``accounting.kernels.kernel_fn``):

* :data:`CPU_KERNELS` -- CPU kernels (ATen, oneDNN) of a run on the CPU: ``model(call)``;
* :data:`CUDA_KERNELS` -- CUDA kernels of a run on a GPU: ``model(call, capability)``;
* :data:`CUDA_WHAT_IF_KERNELS` -- ops of a CPU run that stand for CUDA kernels in a CUDA what-if
  (the step ran on the CPU; the accounting is CUDA's): ``model(call, capability)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_memest.engine.events import OpCall
from lightning_memest.registry import OpRegistry

__all__ = [
    "CPU_KERNELS",
    "CUDA_KERNELS",
    "CUDA_WHAT_IF_KERNELS",
    "Capability",
    "CudaKernelModel",
    "KernelMemory",
    "KernelModel",
]


@dataclass(frozen=True, slots=True)
class KernelMemory:
    """What a real kernel allocates that its fake kernel does not show."""

    workspace_bytes: int = 0  # held only inside the op (allocated and freed by the kernel)
    workspace_after_outputs: bool = True  # whether the op's outputs are already allocated meanwhile
    # Per flattened output (torch.utils._pytree.tree_leaves order): bytes the real kernel's storage has
    # beyond the fake one's; None when no output is under-reported.
    extra_output_bytes: tuple[int, ...] | None = None


#: A GPU's compute capability ``(major, minor)``; ``None`` when unknown.
Capability = tuple[int, int] | None
#: ``model(call) -> KernelMemory | None`` for CPU kernels (``None``: nothing beyond the fake outputs).
KernelModel = Callable[[OpCall], "KernelMemory | None"]
#: ``model(call, capability) -> KernelMemory | None`` for CUDA kernels.
CudaKernelModel = Callable[[OpCall, Capability], "KernelMemory | None"]

CPU_KERNELS: OpRegistry[KernelModel] = OpRegistry("CPU kernel models")
CUDA_KERNELS: OpRegistry[CudaKernelModel] = OpRegistry("CUDA kernel models")
CUDA_WHAT_IF_KERNELS: OpRegistry[CudaKernelModel] = OpRegistry("CUDA what-if kernel models")
