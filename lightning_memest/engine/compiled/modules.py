"""Which modules ``torch.compile`` compiled, and compiled code run eagerly where a simulation asks.

A simulation runs compiled modules compiled (``engine.compiled.dynamo_state``); where it runs them
eagerly (asked to, or after their compile failed on fake tensors) how they are made to matters:
under ``torch._dynamo.config.patch(disable=True)`` dynamo's frame callback still runs and marks each
code object it sees as skipped for good (``convert_frame``: "Dynamo tracing is disabled",
``apply_to_code``), so a module whose first call was the simulation -- the callback estimates before
the first real step -- was never compiled afterwards, nor was any other module sharing its
``forward``'s code (measured: dynamo's frame counts ``{}``). The ``force_eager``
stance (``torch.compiler.set_stance``) installs no frame callback at all: nothing is marked, and the
first real call compiles as it would have.

:func:`compiled_modules` names the modules of a model that are compiled (``torch.compile(module)``'s
``OptimizedModule``, or ``module.compile()``), for the estimate to name them; :func:`inside_compiled`
the modules whose hooks dynamo would trace (a hook of the simulation there breaks the real graph).

Example:
    >>> import torch
    >>> from torch._dynamo.utils import counters
    >>> counters.clear()  # (what this process compiled before)
    >>> net = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    >>> with eager_compiled():
    ...     _ = net(torch.ones(1, 2))
    >>> dict(counters["frames"])  # nothing compiled, nothing marked
    {}
    >>> _ = net(torch.ones(1, 2))
    >>> counters["frames"]["ok"]
    1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lightning_memest.engine.fake import outermost_modules

__all__ = ["compiled_modules", "eager_compiled", "inside_compiled"]


@contextlib.contextmanager
def eager_compiled() -> Iterator[None]:
    """Inside the block, compiled modules and functions run their eager code, and dynamo neither
    compiles nor marks anything; its stance is put back on every way out."""
    with torch.compiler.set_stance("force_eager"):
        yield


def compiled_modules(model: nn.Module) -> tuple[str, ...]:
    """The dotted paths (``""``: the model itself) of ``model``'s modules that ``torch.compile`` wraps
    (an ``OptimizedModule``), that were compiled in place (``module.compile()``), or whose forward
    Lightning compiled (a fit of ``torch.compile(lightning_module)``), outermost only."""
    return outermost_modules(model, _compiled)


def inside_compiled(model: nn.Module) -> tuple[frozenset[int], tuple[nn.Module, ...]]:
    """The ids of ``model``'s modules that run inside compiled code, and the modules compiled in place.

    Dynamo traces the hooks of every module its frame calls, so a hook of the simulation there would be
    compiled into (and break) the graph the real run does not break: such modules get none. That is
    everything below a compiled module; a module compiled in place (``module.compile()``: its whole
    ``_call_impl``, hooks included, is the compiled frame) is inside too, and is returned apart for the
    simulation to mark its scope around the compiled call instead.

    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    >>> net[1].compile()
    >>> ids, in_place = inside_compiled(net)
    >>> [p for p, m in net.named_modules() if id(m) in ids], in_place == (net[1],)
    (['1', '1.0'], True)
    """
    inside: set[int] = set()
    in_place: list[nn.Module] = []
    for path in compiled_modules(model):
        root = model.get_submodule(path)
        own = getattr(root, "_compiled_call_impl", None) is not None
        for sub in root.modules():
            if sub is not root or own:
                inside.add(id(sub))
        if own:
            in_place.append(root)
    return frozenset(inside), tuple(in_place)


def _compiled(module: nn.Module) -> bool:
    wrapped = type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")
    # Lightning's fit of ``torch.compile(lightning_module)`` unwraps it and compiles its forward,
    # keeping what it did in ``_compiler_ctx`` (lightning/pytorch/utilities/compile.py).
    lightning = getattr(module, "_compiler_ctx", None) is not None
    return wrapped or lightning or getattr(module, "_compiled_call_impl", None) is not None
