"""The batch-size search: the largest batch whose estimate fits a budget, on fake tensors.

Where each part lives: ``batch_size.py`` (:func:`max_batch_size`, the search over any peak model),
``calibration.py`` (the search with this machine's kernels: two sizes calibrated in full, the others
fitted), ``worker.py`` (its worker process: probes in pairs), ``sizing.py`` (``SizedStep``: a step as
estimated, its batch size left open -- what the callback, the advice and the planner resize).

    >>> import torch
    >>> from lightning_memest.search import max_batch_size
    >>> make = lambda n: torch.empty(n, 64, device="meta")
    >>> max_batch_size(torch.nn.Linear(64, 64), make, 2**20).max_batch_size > 0
    True
"""

from lightning_memest.search.batch_size import (
    DEFAULT_CAP,
    BatchSizeResult,
    ProbeModel,
    Progress,
    can_fork,
    max_batch_size,
    search_batch_size,
    search_steps,
)

__all__ = [
    "DEFAULT_CAP",
    "BatchSizeResult",
    "ProbeModel",
    "Progress",
    "can_fork",
    "max_batch_size",
    "search_batch_size",
    "search_steps",
]
