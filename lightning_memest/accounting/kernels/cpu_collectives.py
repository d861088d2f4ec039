"""gloo's collectives on the CPU: the buffers its implementations allocate inside a call, which the
fake process group (it moves no data) does not.

A CPU job's process group is gloo's. Measured with the profiler's allocator events on a real 2-rank
job (1 MiB input, torch 2.14.1; ``benchmarks/gloo_collectives.py`` prints them):

- ``reduce_scatter_tensor`` (``c10d._reduce_scatter_base_``) and the functional
  ``reduce_scatter_tensor`` work on a copy of the input: the input's bytes, freed when a synchronous
  call returns (FSDP2's reduce-scatter) -- held until the work is released (an asynchronous call's
  ``wait``, a functional collective's ``wait_tensor``) otherwise, which is modelled as inside the call;
- ``all_gather_into_tensor`` (``c10d._allgather_base_``), ``all_gather`` into a list
  (``c10d.allgather_``), the coalesced and the functional all-gathers: a buffer of the output's size,
  allocated and freed inside the call (twice, one after the other);
- ``reduce_scatter`` from a list (``c10d.reduce_scatter_``): a buffer of the output's size;
- ``all_reduce`` and ``broadcast``: nothing (in place).

Each is a workspace of the call (held while it runs, beside its outputs): where a step's peak falls
inside a collective -- FSDP2's reduce-scatter in backward -- the estimate holds it too.

Example:
    >>> import torch
    >>> from lightning_memest.accounting.kernels import OpCall, TensorMeta, kernel_memory
    >>> grads, shard = TensorMeta.of(torch.empty(1024, 256)), TensorMeta.of(torch.empty(512, 256))
    >>> op = torch.ops.c10d._reduce_scatter_base_.default
    >>> kernel_memory(OpCall(op, (shard, grads, None, None, False), {}, (shard,), "cpu")).workspace_bytes
    1048576
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from lightning_memest.accounting.kernels.model import CPU_KERNELS, KernelMemory
from lightning_memest.engine.events import OpCall, TensorMeta

__all__: list[str] = []


def _bytes(value: object) -> int:
    """The bytes of every tensor in ``value`` (a tensor, or lists of them)."""
    return sum(t.bytes for t in tree_leaves(value) if isinstance(t, TensorMeta))


def _copy_of_input(call: OpCall) -> KernelMemory | None:
    """A reduce-scatter's copy of its input: ``(output, input, ...)`` for c10d's op, ``(input, ...)``
    for the functional one."""
    if call.device_type != "cpu" or not call.args:
        return None
    functional = call.op.namespace == "_c10d_functional"
    size = _bytes(call.args[0] if functional else call.args[1] if len(call.args) > 1 else None)
    return KernelMemory(size) if size else None


def _output_sized(call: OpCall) -> KernelMemory | None:
    """A gathering buffer of the output's size: c10d's ops take their outputs first; a functional
    collective returns its output."""
    if call.device_type != "cpu":
        return None
    functional = call.op.namespace == "_c10d_functional"
    size = _bytes(call.outputs if functional else call.args[:1])
    return KernelMemory(size) if size else None


if torch.distributed.is_available():
    c10d, functional = torch.ops.c10d, torch.ops._c10d_functional
    CPU_KERNELS.register(c10d._reduce_scatter_base_, functional.reduce_scatter_tensor)(_copy_of_input)
    CPU_KERNELS.register(
        c10d._allgather_base_,
        c10d.allgather_,
        c10d.allgather_into_tensor_coalesced_,
        c10d.reduce_scatter_,
        functional.all_gather_into_tensor,
    )(_output_sized)
