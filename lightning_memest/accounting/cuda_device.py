"""What a CUDA device holds beyond the tensors of a step: library workspaces and the CUDA context.

The numbers follow PyTorch's own choices (``aten/src/ATen/cuda/CublasHandlePool.cpp``):

* cuBLAS keeps one workspace per (handle, stream), taken from the caching allocator at the first
  matmul and kept: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs) when set, else
  ``":4096:2:16:8"`` = 8,519,680 B, or 32 MiB on compute capability 9.x (Hopper), 10.x and 12.x
  (Blackwell).
* cuBLASLt shares that workspace by default on CUDA builds (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``
  unset or true). With it switched off, cuBLASLt has its own: ``CUBLASLT_WORKSPACE_SIZE`` KiB,
  default 1024 KiB, at the first matmul that goes through it (``addmm`` with a bias).
* The CUDA context (driver state, loaded kernels, library handles) is outside the caching allocator:
  ``nvidia-smi`` shows about reserved + context. On a GPU it is measured (``mem_get_info``'s used bytes
  less what the allocator reserves, at the time of the estimate; kernels loaded lazily later add to
  it); without one it is :data:`DEFAULT_CONTEXT_BYTES`, an assumption.

Example:
    >>> cublas_workspace_bytes(capability=(8, 0), config=None)
    8519680
    >>> cublas_workspace_bytes(capability=(9, 0), config=None)
    33554432
    >>> cublas_workspace_bytes(capability=(9, 0), config=":4096:2")
    8388608
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_CONTEXT_BYTES",
    "CudaDevice",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "library_workspace",
]

#: The CUDA context assumed where it cannot be measured (no GPU here): PyTorch's context with lazily
#: loaded kernels is typically 0.3-0.6 GiB; unmeasured by this project so far.
DEFAULT_CONTEXT_BYTES = 512 * 2**20

_PYTORCH_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"
_LARGE_DEFAULT = 4096 * 8 * 1024  # 32 MiB
_LARGE_WORKSPACE_MAJORS = frozenset({9, 10, 12})

#: Matmuls that call cuBLAS (and take its workspace).
_CUBLAS_OPS = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten.addbmm",
        "aten.mv",
        "aten.addmv",
        "aten._addmm_activation",
    }
)
#: Matmuls PyTorch sends through cuBLASLt (a bias epilogue).
_CUBLASLT_OPS = frozenset({"aten.addmm", "aten._addmm_activation"})


@dataclass(frozen=True)
class CudaDevice:
    """The GPU an estimate is for.

    ``capability`` (``(major, minor)``) picks the library defaults; ``None`` when unknown (a what-if
    without one given: PyTorch's pre-Hopper defaults). ``total_bytes`` is the device's memory when
    known; ``context_bytes`` what the CUDA context takes outside the caching allocator.
    """

    capability: tuple[int, int] | None = None
    total_bytes: int | None = None
    context_bytes: int = DEFAULT_CONTEXT_BYTES
    context_measured: bool = False
    """Whether ``context_bytes`` was measured on this GPU (:meth:`local`)."""
    context_given: bool = False
    """Whether ``context_bytes`` is the user's figure (``memest --cuda-context``)."""

    @property
    def context_assumed(self) -> bool:
        """Whether ``context_bytes`` is :data:`DEFAULT_CONTEXT_BYTES`'s assumption: neither measured on
        the GPU nor given."""
        return not (self.context_measured or self.context_given)

    @staticmethod
    def local(device: torch.device) -> CudaDevice:
        """This machine's GPU, with its context measured now (see the module docstring)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        used = total - free
        context = max(0, used - torch.cuda.memory_reserved(index))
        return CudaDevice(torch.cuda.get_device_capability(index), total, context, True)


def cublas_workspace_bytes(capability: tuple[int, int] | None, config: str | None) -> int:
    """cuBLAS's workspace per (handle, stream), as PyTorch sizes it (``config``: the value of
    ``CUBLAS_WORKSPACE_CONFIG``, ``None`` when unset; unparsable values fall back to the default)."""
    default = (
        _LARGE_DEFAULT
        if capability is not None and capability[0] in _LARGE_WORKSPACE_MAJORS
        else _PYTORCH_DEFAULT
    )
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        return default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublaslt_workspace_bytes(unified: str | None, size_kib: str | None) -> int:
    """cuBLASLt's own workspace: 0 when it shares cuBLAS's (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``
    unset or true, PyTorch's default on CUDA builds), else ``CUBLASLT_WORKSPACE_SIZE`` KiB (1024).

    >>> cublaslt_workspace_bytes(None, None), cublaslt_workspace_bytes("0", None)
    (0, 1048576)
    """
    if unified is None or unified.strip().lower() not in ("0", "false", "no", "off"):
        return 0
    try:
        return int(size_kib) * 1024 if size_kib is not None else 1024 * 1024
    except ValueError:
        return 1024 * 1024


def library_workspace(op: str, capability: tuple[int, int] | None) -> list[tuple[str, int]]:
    """``(library, bytes)`` the libraries behind a CUDA op take from the caching allocator once (at their
    first use) and keep, from this process's environment.

    >>> library_workspace("aten.addmm.default", (9, 0))
    [('cublas', 33554432)]
    >>> library_workspace("aten.relu.default", (9, 0))
    []
    """
    packet = op.rsplit(".", 1)[0]
    if packet not in _CUBLAS_OPS:
        return []
    env = os.environ
    found = [("cublas", cublas_workspace_bytes(capability, env.get("CUBLAS_WORKSPACE_CONFIG")))]
    if packet in _CUBLASLT_OPS:
        lt = cublaslt_workspace_bytes(
            env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE"), env.get("CUBLASLT_WORKSPACE_SIZE")
        )
        if lt:
            found.append(("cublaslt", lt))
    return found
