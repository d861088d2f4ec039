"""The Lightning adapter: everything that imports ``lightning``, and every use of its private APIs.

Where each concept lives: ``callback.py`` (``MemEstimate``), ``fit_batch_size.py`` (``FitBatchSize``),
``fit.py`` (the trainer read once: ``fit_setup``, the estimate and search entry points, the first batch),
``runner.py`` (a training batch in the fit loop's order, for the fake engine), ``summary.py`` (the
estimate in Lightning's model summary), ``loggers/`` (one file per logger kind: ``tensorboard.py``).
"""

from lightning_memest.adapter.callback import MemEstimate
from lightning_memest.adapter.fit_batch_size import FitBatchSize

__all__ = ["FitBatchSize", "MemEstimate"]
