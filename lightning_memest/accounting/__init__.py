"""Accounting: pure functions over a simulation's event stream, from events to the ``StepEstimate``.

Where each concept lives: ``account.py`` (events -> report, and the peak alone for searches),
``replay.py`` (the one walker, roles, live bytes, the caching allocator replay), ``kernels/`` (what
real kernels allocate beyond the fake outputs, per device), ``flops/`` (FLOP formulas and the count),
``attribution.py`` (per-module and per-fx-node figures, the values read), ``cuda_allocator.py`` (the
CUDA caching allocator model), ``cuda_alloc_conf.py`` (its settings from the environment),
``cuda_device.py`` (library workspaces, the CUDA context). Every formula table is an ``OpRegistry``
(``lightning_memest/registry.py``).
"""

from lightning_memest.accounting.account import (
    PeakProfile,
    account,
    capture_filter,
    live_bytes,
    peak_bytes,
    peak_profile,
)

__all__ = ["PeakProfile", "account", "capture_filter", "live_bytes", "peak_bytes", "peak_profile"]
