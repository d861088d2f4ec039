"""Lightning as either package ships it: ``lightning.pytorch`` and the standalone ``pytorch_lightning``.

Both are maintained, from one source: the same classes under two names. Libraries build on either
(neuralforecast on ``pytorch_lightning``; pytorch-forecasting on both), and a trainer of one never
holds the other's objects. The callback is written once, against ``lightning.pytorch``, and duck-typed
where it calls Lightning; where it asks what an object *is* (a ``LightningModule``, a ``ModelSummary``
callback, a ``DDPStrategy``), it asks :func:`lightning_classes`, which answers with the class of each
package that is imported. ``pytorch_lightning`` is never imported here: a fit with its trainer has
imported it already.

Example:
    >>> import torch
    >>> from lightning.pytorch.demos.boring_classes import BoringModel
    >>> isinstance(BoringModel(), lightning_classes("LightningModule"))
    True
    >>> isinstance(torch.nn.Linear(2, 2), lightning_classes("LightningModule"))
    False
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["base_method", "is_lightning_module", "lightning_classes"]

#: Where each class asked for lives in ``lightning.pytorch`` (and in ``pytorch_lightning``).
_WHERE = {
    "LightningModule": "",
    "ModelSummary": "callbacks",
    "RichModelSummary": "callbacks",
    "TQDMProgressBar": "callbacks",
    "WeightAveraging": "callbacks",
    "DDPStrategy": "strategies",
    "TensorBoardLogger": "loggers",
    "LightningOptimizer": "core.optimizer",
}

#: The packages, by the name they are imported as.
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def lightning_classes(name: str) -> tuple[type, ...]:
    """The class ``name`` (one of :data:`_WHERE`'s) of ``lightning.pytorch`` and, where it is imported,
    of ``pytorch_lightning``: a tuple for ``isinstance``. A class a package's release lacks
    (``WeightAveraging`` before 2.6) is left out."""
    loaded = tuple(p for p in _PACKAGES if p in sys.modules or p == "lightning.pytorch")
    return _classes(name, loaded)


@functools.cache
def _classes(name: str, packages: tuple[str, ...]) -> tuple[type, ...]:
    if name not in _WHERE:
        raise KeyError(f"no Lightning class {name!r} is looked up here; known: {', '.join(_WHERE)}")
    found: list[type] = []
    for package in packages:
        where = f"{package}.{_WHERE[name]}" if _WHERE[name] else package
        cls = getattr(importlib.import_module(where), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def is_lightning_module(obj: object) -> TypeGuard[pl.LightningModule]:
    """Whether ``obj`` is a ``LightningModule`` of either package."""
    return isinstance(obj, lightning_classes("LightningModule"))


def base_method(obj: object, name: str) -> object:
    """Method ``name`` of the ``LightningModule`` base class ``obj`` derives from (either package's),
    for telling whether the user overrode it; ``None`` where ``obj`` is no ``LightningModule``."""
    for cls in lightning_classes("LightningModule"):
        if isinstance(obj, cls):
            return getattr(cls, name, None)
    return None
