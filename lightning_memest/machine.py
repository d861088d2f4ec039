"""Facts about this machine that change what kernels allocate, and what memory it has available.

Kernel memory depends on the machine: oneDNN picks its algorithms (and their scratch buffers) by the
CPU's instruction set (AVX-512 with or without native bf16, AMX) and the thread count; cuDNN and
cuBLAS by the GPU, their versions and some environment variables. :func:`machine_facts` gathers what
matters for a device, and :func:`machine_key` names them in a short hash: calibrated kernel memory
(``accounting/kernels/calibrate.py``) is filed under it, so that a cache never answers for another
machine. :func:`mem_available` is the memory the host can still hand out.

Example:
    >>> facts = machine_facts("cpu")
    >>> facts["device"], facts["threads"] > 0, len(machine_key("cpu"))
    ('cpu', True, 16)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from typing import Any

import torch

__all__ = ["cpu_flags", "cpu_model", "machine_facts", "machine_key", "mem_available"]

#: CPU flags (``/proc/cpuinfo``) that change which kernels oneDNN runs: AVX2, AVX-512 itself (oneDNN's
#: ``avx512_core`` needs all four of F, BW, VL and DQ) and the low-precision extensions.
_KERNEL_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
    "amx_int8",
    "avx512_vnni",
    "avx_vnni",
)
#: Environment variables that change which kernels run (or how much workspace they take).
_KERNEL_ENV = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
    "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT",
    "TORCH_CUDNN_V8_API_DISABLED",
    "CUDNN_CONV_WSCAP_DBG",
)


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The CPU's flags among those that change oneDNN's kernels (empty where /proc is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in _KERNEL_FLAGS if flag in present)
    except OSError:
        pass
    return ()


@functools.cache
def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``): its cache sizes change some of oneDNN's blockings."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def _onednn_version() -> str | None:
    match = re.search(r"MKL-DNN v([0-9.]+)", torch.__config__.show())
    return match.group(1) if match else None


def machine_facts(device: str | torch.device) -> dict[str, Any]:
    """What decides the kernels of ``device`` here: the torch release, and for the CPU its ISA, model
    (cache sizes), flags, oneDNN release and thread count; for a GPU its name, compute capability,
    CUDA/cuDNN releases and cuDNN's flags; and the environment variables that change kernels."""
    dev = torch.device(device)
    facts: dict[str, Any] = {"device": dev.type, "torch": torch.__version__}
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        facts.update(
            gpu=torch.cuda.get_device_name(index),
            capability=list(torch.cuda.get_device_capability(index)),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,  # type: ignore[no-untyped-call]
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
    else:
        facts.update(
            capability=torch.backends.cpu.get_cpu_capability(),
            model=cpu_model(),
            flags=list(cpu_flags()),
            onednn=_onednn_version(),
            threads=torch.get_num_threads(),
        )
    facts["env"] = {name: os.environ[name] for name in _KERNEL_ENV if name in os.environ}
    return facts


def machine_key(device: str | torch.device) -> str:
    """A short, stable name for :func:`machine_facts` of ``device``."""
    text = json.dumps(machine_facts(device), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out without swapping); psutil's
    figure where there is no ``/proc`` and psutil is installed; ``None`` when neither says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    except OSError:
        pass
    try:
        import psutil  # optional: only where /proc is missing
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)
