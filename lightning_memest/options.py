"""The checks every public entry runs on its options before it simulates anything: one sentence that
names the option, a ``TypeError`` for a value of the wrong type and a ``ValueError`` for one out of
range, as Python's own functions raise them.

The rules, the same at every entry (``estimate_step``, ``max_batch_size``, ``plan_checkpointing``,
``CheckpointPlan.apply``, ``FitBatchSize``, ``MemEstimate``):

* a flag is ``True`` or ``False``: not ``"no"`` (which is truthy), not ``None``, not ``1``;
* a count or a size is an ``int`` (not a ``bool``, a ``float`` or a ``str``) of at least its minimum;
* ``model`` is a ``torch.nn.Module``; ``strategy`` is ``lightning_memest.DDP``/``FSDP`` or ``None``;
* a collection of names (``kinds``, ``modules``) is a list, tuple or set of strings, never a bare
  string (it would be read one character at a time): ``kinds=("full",)``.

It imports nothing of the package but ``sizes`` when it is imported, so that every layer may use it.

Example:
    >>> check_flag("replay_blocks", "no")
    Traceback (most recent call last):
    ...
    TypeError: replay_blocks must be True or False; got 'no'
    >>> check_count("max_batch_size", 0)
    Traceback (most recent call last):
    ...
    ValueError: max_batch_size must be at least 1; got 0
    >>> check_names("kinds", "full", known=("full", "selective"), nonempty=True)
    Traceback (most recent call last):
    ...
    TypeError: kinds must be a collection of names, not one string: kinds=('full',); got 'full'
    >>> check_names("kinds", ["selective", "full"], known=("full", "selective"), nonempty=True)
    ('selective', 'full')
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from lightning_memest.sizes import MemoryBudget

if TYPE_CHECKING:
    from lightning_memest.engine.parallel.distributed import Strategy

__all__ = [
    "check_budget",
    "check_callable",
    "check_choice",
    "check_count",
    "check_device",
    "check_flag",
    "check_fraction",
    "check_int",
    "check_model",
    "check_names",
    "check_step_options",
    "check_strategy",
]

_T = TypeVar("_T")


def _got(value: object) -> str:
    """A value as an error shows it: its repr, and its type where the repr does not say it."""
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if value is None or isinstance(value, (bool, int, str)):
        return shown if not isinstance(value, str) else f"{shown} (a str)"
    return f"{shown} (a {type(value).__name__})"


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; a ``TypeError`` naming ``name`` otherwise (``"no"``
    is truthy: taken as is, it would turn the option on)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def check_int(name: str, value: object) -> int:
    """``value`` if it is an ``int`` (a ``bool`` is not one here); a ``TypeError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {_got(value)}")
    return value


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """``value`` if it is an ``int`` of at least ``minimum``: a ``TypeError`` for another type, a
    ``ValueError`` below it.

    >>> check_count("steps", "2")
    Traceback (most recent call last):
    ...
    TypeError: steps must be an int; got '2' (a str)
    """
    number = check_int(name, value)
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}; got {number}")
    return number


def check_fraction(name: str, value: object, why: str = "") -> float:
    """``value`` if it is a real number in ``[0, 1)``; a ``TypeError`` for another type (a ``str``,
    a ``bool``), a ``ValueError`` outside (NaN included). ``why`` says what the number means."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number in [0, 1){why}; got {_got(value)}")
    number = float(value)
    if not 0 <= number < 1:
        raise ValueError(f"{name} must be in [0, 1){why}; got {value}")
    return number


def check_choice(name: str, value: object, choices: Sequence[_T]) -> _T:
    """``value`` if it is one of ``choices`` (strings); a ``TypeError`` for a value that is not a
    string, a ``ValueError`` naming the choices for one that is not among them."""
    listed = ", ".join(map(str, choices))  # as engine.step's precision and the loops' errors list them
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {listed}; got {_got(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {listed}; got {value!r}")
    return value  # type: ignore[return-value]


def check_names(
    name: str, value: object, *, known: Sequence[str] | None = None, nonempty: bool = False
) -> tuple[str, ...]:
    """The names a collection holds, in order, each once: ``value`` must be an iterable of non-empty
    strings (``known`` ones only, where given; at least one with ``nonempty``). A bare string is
    refused with the spelling that was meant (``kinds=('full',)``), not iterated character by
    character."""
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"{name} must be a collection of names, not one string: {name}=({value!r},); got {value!r}"
        )
    if not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a collection of names (a list or tuple of str); got {_got(value)}")
    items = list(value)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{name} must hold names (str); it holds {_got(item)}")
        if known is not None and item not in known:
            raise ValueError(f"{name} must hold only {' or '.join(map(repr, known))}; got {item!r}")
        if not item:
            raise ValueError(f"{name} must not hold an empty name")
    names = tuple(dict.fromkeys(items))
    if nonempty and not names:
        listed = f" of {', '.join(map(repr, known))}" if known is not None else ""
        raise ValueError(f"{name} must name at least one{listed}; got {value!r}")
    return names


def check_callable(name: str, value: object, what: str) -> None:
    """A ``TypeError`` naming ``name`` unless ``value`` is callable (``what`` says as what)."""
    if not callable(value):
        raise TypeError(f"{name} must be callable as {what}; got {_got(value)}")


def check_model(value: object, name: str = "model") -> nn.Module:
    """``value`` if it is a ``torch.nn.Module``; a ``TypeError`` otherwise.

    >>> check_model(None)
    Traceback (most recent call last):
    ...
    TypeError: model must be a torch.nn.Module; got None
    """
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module; got {_got(value)}")
    return value


def check_strategy(value: object) -> Strategy | None:
    """``value`` if it is ``None`` or a strategy (``DDP(...)``, ``FSDP(...)``, ``TP``, ``ModelParallel``,
    ``Pipeline``); a ``TypeError`` saying what to pass
    otherwise (a string names no world size).

    >>> check_strategy("ddp")
    Traceback (most recent call last):
    ...
    TypeError: strategy must be lightning_memest.DDP(world_size), FSDP(world_size), TP(world_size, plan=...), ModelParallel(data_parallel, tensor_parallel, plan=...), Pipeline(stages, split=..., microbatches=...) or None; got the string 'ddp': pass strategy=DDP(world_size=N)
    """  # noqa: E501
    # Imported here: this module is a leaf that any layer, the engine's own included, may import.
    from lightning_memest.engine.parallel.distributed import DDP, FSDP, TP, ModelParallel, Pipeline

    if value is None or isinstance(value, (DDP, FSDP, TP, ModelParallel, Pipeline)):
        return value
    wanted = (
        "strategy must be lightning_memest.DDP(world_size), FSDP(world_size), TP(world_size, plan=...), "
        "ModelParallel(data_parallel, tensor_parallel, plan=...), Pipeline(stages, split=..., "
        "microbatches=...) or None"
    )
    if isinstance(value, str):
        hints = {
            "ddp": "DDP(world_size=N)",
            "fsdp": "FSDP(world_size=N)",
            "tp": "TP(world_size=N)",
            "pp": "Pipeline(stages=N, split=..., microbatches=M)",
        }
        meant = hints.get(value.strip().lower())
        hint = f"strategy={meant}" if meant else "one of them"
        raise TypeError(f"{wanted}; got the string {value!r}: pass {hint}")
    raise TypeError(f"{wanted}; got {_got(value)}")


def check_device(value: object) -> None:
    """``None``, or a CPU or CUDA device as a string (``"cuda:1"``) or a ``torch.device``."""
    wanted = "device must be 'cpu', 'cuda' or 'cuda:N' (a str or a torch.device), or None"
    if value is None:
        return
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{wanted}; got {_got(value)}")
    try:
        device = torch.device(value)
    except RuntimeError:  # torch's own message lists every device type it knows
        raise ValueError(f"{wanted}; got {value!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{wanted}; got {value!r}")


def check_budget(name: str, value: object) -> MemoryBudget:
    """A budget given as bytes, a size (``"10GiB"``) or a share (``"80%"``), parsed; its error names
    ``name``.

    >>> check_budget("budget", "lots")
    Traceback (most recent call last):
    ...
    ValueError: budget: a size is a number and an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, K, M, G, T) such as 10GiB or 1.5GB; got 'lots'
    """  # noqa: E501
    try:
        return MemoryBudget.parse(value)  # type: ignore[arg-type]  # its TypeError says what it takes
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None


def check_step_options(
    *,
    model: object,
    steps: object,
    strategy: object,
    device: object,
    gpu: object,
    calibrate: object,
    replay_blocks: object,
) -> None:
    """The options ``estimate_step``, ``max_batch_size`` and ``plan_checkpointing`` share (the loss,
    optimizer and precision are ``StepConfig``'s to check)."""
    check_model(model)
    check_count("steps", steps)
    check_strategy(strategy)
    check_device(device)
    from lightning_memest.accounting.cuda_device import CudaDevice  # see check_strategy

    if gpu is not None and not isinstance(gpu, CudaDevice):
        raise TypeError(
            f"gpu must be a CudaDevice (lightning_memest.accounting.cuda_device) or None; got {_got(gpu)}"
        )
    check_flag("calibrate", calibrate)
    check_flag("replay_blocks", replay_blocks)
