"""Following the real values where an assumed read made the step fail: the control flow of an adaptive
solver, a check of a float tensor's range.

Why: a read of an unknown value gets an assumed answer (``engine.values.data_dependent``), and most
code takes that in its stride. Code whose control flow is arithmetic on activations does not: an
adaptive ODE solver (torchdiffeq's ``dopri5``) picks its first step from norms of the state, accepts
or rejects each step by its error, and asserts ``t0 + dt > t0`` -- on assumed answers it fails
("underflow in dt") or never reaches its end time. Its real step count, and so its memory, follows
from the values alone. Where such a failure came after an assumed read, and every floating-point
tensor of the model and the batch has at most :data:`FOLLOW_LIMIT` elements, the step is simulated
again with their values known (copies on the CPU; the model and batch are never touched): every op
whose inputs are known also runs on the values beside the fake run, so the reads are answered as this
batch and these weights answer them, and the loop runs as many times as the real one does now.

What that is: exact for this batch and these weights, not for every batch -- a solver takes more
steps as training stiffens its dynamics. The report says the step was followed (``Simulation.
followed_note``), each read answered from the values is listed as one that could lower the estimate,
with its count (the loop's trip count), and nothing is called an upper bound that is not.

Example:
    >>> from lightning_memest.engine.values.followed_values import float_value_limit, following_values
    >>> float_value_limit(4096)
    4096
    >>> with following_values():
    ...     float_value_limit(4096)
    1048576
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from torch import Tensor

from lightning_memest.engine.values.read_guard import call_site
from lightning_memest.errors import EstimationError

__all__ = [
    "FOLLOW_LIMIT",
    "AssumedReadFailure",
    "float_value_limit",
    "followable",
    "following_values",
    "not_followable",
    "read_site",
    "unfollowed",
    "values_followed",
]

#: The most elements a floating-point tensor of the model or batch may have for a failed step to be
#: followed on its values: each op on known values runs a second time on the CPU, beside the fake one.
FOLLOW_LIMIT = 1 << 20

_FOLLOWING: ContextVar[bool] = ContextVar("memest_following_values", default=False)


class AssumedReadFailure(EstimationError):
    """The step failed after an assumed read (``error``: the failure as it would be reported): it may
    be the assumption's doing, so the simulation follows the values if it can."""

    def __init__(self, error: EstimationError) -> None:
        super().__init__(str(error))
        self.error = error


@contextmanager
def following_values() -> Iterator[None]:
    """Inside: floating-point tensors of the model and the batch of up to :data:`FOLLOW_LIMIT` elements
    have known values (``engine.real_path``)."""
    token = _FOLLOWING.set(True)
    try:
        yield
    finally:
        _FOLLOWING.reset(token)


def values_followed() -> bool:
    """Whether the simulation being built follows the values (inside :func:`following_values`)."""
    return _FOLLOWING.get()


def float_value_limit(default: int) -> int:
    """The most elements a floating-point tensor may have for its value to be known: ``default``, or
    :data:`FOLLOW_LIMIT` while following."""
    return FOLLOW_LIMIT if _FOLLOWING.get() else default


def followable(t: Tensor) -> bool:
    """Whether ``t`` is a floating-point tensor whose values a followed step computes with: at most
    :data:`FOLLOW_LIMIT` elements, not meta."""
    return t.is_floating_point() and not t.is_meta and t.numel() <= FOLLOW_LIMIT


def not_followable(tensors: Iterable[tuple[str, Tensor]]) -> str | None:
    """Why a step on these ``(name, tensor)`` pairs (the model's and the batch's) cannot be followed on
    its values -- its largest floating-point tensor is over :data:`FOLLOW_LIMIT` elements, or one has no
    values (meta) -- or ``None`` when it can."""
    for name, t in tensors:
        if not t.is_floating_point():
            continue
        if t.is_meta:
            return f"{name} has no values (meta)"
        if t.numel() > FOLLOW_LIMIT:
            return (
                f"{name} has {t.numel():,} elements, more than the {FOLLOW_LIMIT:,} whose values the "
                f"simulation computes beside the fake run"
            )
    return None


def read_site() -> str:
    """Where the code that reads a value is (``engine.values.read_guard.call_site``), its file named
    from its package on (``torchdiffeq/_impl/rk_common.py:244 (_advance)``)."""
    site = call_site(sys._getframe(1))
    for root in sorted(sys.path, key=len, reverse=True):
        if root and site.startswith(root.rstrip("/") + "/"):
            return site[len(root.rstrip("/")) + 1 :]
    return site


def unfollowed(error: EstimationError, why: str) -> EstimationError:
    """``error``, saying that the step read values it did not have before it failed, and why it was
    not simulated again on them."""
    said = EstimationError(
        f"{error}; before it failed the step read values the fake run does not have (answered by "
        f"assumption: engine.values.data_dependent), and it was not simulated again on the real "
        f"values: {why}"
    )
    said.op, said.module = error.op, error.module
    return said
