"""Library kernels that write tensors through data pointers -- which fake tensors do not have --
replaced by the same ops in Python while the simulation runs (restored on exit)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_memest.engine.values.value_sets import ValueLookup, int_values

__all__ = ["pointer_kernels"]


@contextmanager
def pointer_kernels(read: ValueLookup) -> Iterator[None]:
    """Inside, library kernels that write a tensor through its data pointer -- which a fake tensor does
    not have -- are replaced by the same ops in Python (restored on exit).

    ``pad_packed_sequence``'s kernel (C++, decomposed before any mode sees it) fills its ``lengths``
    output through a pointer. (The kernels that only *read* the batch sizes of a packed sequence get a
    real tensor from the ``_pack_padded_sequence`` policy.)
    """
    import torch._VF as vf

    def pad_packed(
        data: Tensor, batch_sizes: Tensor, batch_first: bool, padding_value: float, total_length: int
    ) -> tuple[Tensor, Tensor]:
        return _pad_packed_sequence(read, data, batch_sizes, batch_first, padding_value, total_length)

    setattr(vf, "_pad_packed_sequence", pad_packed)  # noqa: B010 -- an instance attribute of the _VF module
    try:
        yield
    finally:
        delattr(vf, "_pad_packed_sequence")


def _pad_packed_sequence(
    read: ValueLookup,
    data: Tensor,
    batch_sizes: Tensor,
    batch_first: bool,
    padding_value: float,
    total_length: int,
) -> tuple[Tensor, Tensor]:
    """``aten::_pad_packed_sequence`` (aten/src/ATen/native/PackedSequence.cpp), op for op."""
    real = read(batch_sizes)
    steps = batch_sizes.shape[0]
    # unknown batch sizes (a packed sequence built by hand from fake tensors): every sequence full
    sizes = int_values(real) if real is not None else [-(-data.shape[0] // max(steps, 1))] * steps
    longest = max(total_length, steps) if total_length > 0 else steps
    batch = sizes[0] if sizes else 0
    output = torch.full(
        (longest, batch, *data.shape[1:]), padding_value, dtype=data.dtype, device=data.device
    )
    lengths = [0] * batch
    offset, previous, start = 0, batch, 0
    for i in range(steps + 1):
        size = sizes[i] if i != steps else 0
        if size != previous:
            n = previous * (i - start)
            tmp = data[offset : offset + n].view(i - start, previous, *data.shape[1:])
            output[start:i, :previous].copy_(tmp)
            offset, start = offset + n, i
        for j in range(size, previous):
            lengths[j] = i
        previous = size
    if batch_first:
        output = output.transpose(0, 1)
    with unset_fake_temporarily():
        lengths_t = torch.tensor(lengths, dtype=torch.long)  # real, on the CPU, as the kernel's
    return output, lengths_t
