"""The autograd engine's device threads: as many as the real run makes, not eight more.

On a machine without CUDA, entering a ``FakeTensorMode`` installs a stand-in CUDA device guard (so
that fake CUDA tensors can be traced: ``torch._C._ensureCUDADeviceGuardSet``) which reports 8
devices. The autograd engine starts its device threads once per process, at its first backward, one
per device the guards report then. When that first backward is the simulation's -- in a fit the
estimate runs before the first real step -- every process keeps 8 idle ``pt_autograd_*`` threads to
its end, and two-process DDP runs then aborted at exit now and then ("terminate called without an
active exception", SIGABRT; 9 of 43 runs, none without the estimator). A tiny real CPU backward
before the first fake one settles the engine's threads as the real run would have them.

Example:
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> settle_device_threads(FakeTensorMode())  # before the first simulation enters its mode
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["settle_device_threads"]

_settled = False


def settle_device_threads(mode: FakeTensorMode) -> None:
    """Run the process's first backward for real, on the CPU, before ``mode`` is entered -- where
    entering it would install the stand-in CUDA guard (no CUDA, no other accelerator). Once per
    process; nothing where a backward ran before (the engine's threads are settled then)."""
    global _settled
    if _settled or not mode.avoid_device_init:
        return
    _settled = True
    # Outside any mode and with gradients on, whatever the caller's context is.
    with torch.inference_mode(False), torch.enable_grad():
        torch.ones(1, requires_grad=True).sum().backward()  # type: ignore[no-untyped-call]
