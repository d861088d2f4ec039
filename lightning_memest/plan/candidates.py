"""The modules a checkpointing plan chooses among: the model's repeated blocks, and any module named.

A *repeated block* is a module with children of its own whose kind occurs at least twice in the
model -- transformer layers, residual blocks, a UNet's down and up blocks -- taken at the outermost
level where they repeat (a decoder layer, not the linear layers inside it). A module's kind is its
class; a ``Sequential``'s is what it holds (its children's classes and parameter shapes), so that
identical stages repeat and a model's one ``Sequential`` of layers does not. ``ModuleList`` and
``ModuleDict`` have no forward: never blocks. Named modules take the place of any repeated block
inside or around them.

Example:
    >>> from torch import nn
    >>> block = lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.stem, self.blocks, self.head = nn.Linear(4, 8), nn.ModuleList(Res() for _ in range(3)), nn.Linear(8, 2)
    >>> class Res(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.f = block()
    >>> candidates(Net())
    ['blocks.0', 'blocks.1', 'blocks.2']
    >>> candidates(Net(), ["head", "blocks.1"])
    ['blocks.0', 'blocks.1', 'blocks.2', 'head']
"""  # noqa: E501

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from lightning_memest.errors import MemestError

__all__ = ["candidates", "repeated_blocks"]

_NO_FORWARD = (nn.ModuleList, nn.ModuleDict)


def _is_block(module: nn.Module) -> bool:
    return not isinstance(module, (*_NO_FORWARD, CheckpointWrapper)) and any(True for _ in module.children())


def _kind(module: nn.Module) -> object:
    if type(module) is nn.Sequential:
        return tuple(
            (type(child), tuple(tuple(p.shape) for p in child.parameters())) for child in module.children()
        )
    return type(module)


def _named(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield (f"{prefix}.{name}" if prefix else name), child


def repeated_blocks(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s repeated blocks, in module order (see the module docstring);
    a module already checkpointed (torch's ``CheckpointWrapper``) is not offered again."""
    counts = Counter(_kind(m) for m in model.modules() if _is_block(m))
    found: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        for name, child in _named(module, path):
            if isinstance(child, CheckpointWrapper):
                continue
            if _is_block(child) and counts[_kind(child)] >= 2:
                found.append(name)
            else:
                visit(child, name)

    visit(model, "")
    return found


def _within(path: str, other: str) -> bool:
    return path == other or path.startswith(other + ".")


def candidates(model: nn.Module, named: Sequence[str] = ()) -> list[str]:
    """The repeated blocks of ``model`` and the modules ``named`` (qualified names), none inside
    another: a named module replaces the repeated blocks inside or around it. In module order."""
    names = dict.fromkeys(named)
    for path in names:
        try:
            model.get_submodule(path)
        except AttributeError:
            raise MemestError(
                f"the model has no module {path!r} (modules= names modules to checkpoint)"
            ) from None
        for other in names:
            if other != path and _within(path, other):
                raise MemestError(f"modules= names {path!r} inside {other!r}: name one of the two")
    chosen = [b for b in repeated_blocks(model) if not any(_within(b, n) or _within(n, b) for n in names)]
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return sorted([*chosen, *names], key=lambda p: order.get(p, len(order)))
