"""What the step does that no op says, told to the tracker by hooks: which module runs (forward and
backward), what autograd saves for backward, and storages resized behind the dispatcher's back."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

from lightning_memest.engine.events import Role, Tag
from lightning_memest.engine.tracker import Tracker

__all__ = ["module_scopes", "saved_tensor_tags", "storage_resizes"]


@contextmanager
def storage_resizes(tracker: Tracker) -> Iterator[None]:
    """Report every ``UntypedStorage.resize_`` to the tracker while inside."""
    original = torch.UntypedStorage.resize_
    own = "resize_" in vars(torch.UntypedStorage)  # else inherited from torch._C.StorageBase

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        result = original(storage, size)
        tracker.on_storage_resize(storage)
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
        else:
            del torch.UntypedStorage.resize_


@contextmanager
def module_scopes(
    model: nn.Module,
    tracker: Tracker,
    *,
    inside: frozenset[int] = frozenset(),
    in_place: tuple[nn.Module, ...] = (),
) -> Iterator[None]:
    """Tell the tracker which module runs, in forward (module hooks) and in backward.

    Modules whose ids are in ``inside`` run inside compiled code (``engine.compiled.inside_compiled``),
    where dynamo would trace a hook into the graph: they get none, and what runs there counts to the
    compiled module around them. A module in ``in_place`` (compiled in place: its hooks are inside its
    compiled call) has its scope marked around that call instead, for the simulation only.

    A module's backward starts when the autograd node that made its output runs, and ends when the
    nodes that made its inputs run: pre-hooks on those *nodes* say so. (Hooks on the tensors, as
    ``register_multi_grad_hook`` places them, keep memory alive that the real run frees -- the saved
    inputs of activation-checkpointed blocks -- and would make the estimate wrong.)
    """
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def nodes(values: Any) -> list[torch.autograd.graph.Node]:
        found: dict[int, torch.autograd.graph.Node] = {}
        for t in tree_leaves(values):
            if isinstance(t, Tensor) and t.grad_fn is not None:
                found.setdefault(id(t.grad_fn), t.grad_fn)
        return list(found.values())

    wrapped: list[tuple[nn.Module, Any]] = []
    for path, module in model.named_modules():

        def pre_hook(_: nn.Module, args: Any, kwargs: Any, path: str = path) -> None:
            tracker.enter_module(path, backward=False)
            if torch.is_grad_enabled():
                for node in nodes((args, kwargs)):
                    node.register_prehook(lambda _, path=path: tracker.exit_module(path, backward=True))

        def post_hook(_: nn.Module, args: Any, kwargs: Any, output: Any, path: str = path) -> None:
            returned = [t for t in tree_leaves(output) if isinstance(t, FakeTensor)]
            tracker.exit_module(path, backward=False, outputs=returned)
            if torch.is_grad_enabled():
                for node in nodes(output):
                    node.register_prehook(lambda _, path=path: tracker.enter_module(path, backward=True))

        if any(module is m for m in in_place):
            wrapped.append((module, _scope_around_compiled_call(module, pre_hook, post_hook)))
        elif id(module) not in inside:
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(module.register_forward_hook(post_hook, with_kwargs=True, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for module, compiled in wrapped:
            module._compiled_call_impl = compiled


def _scope_around_compiled_call(
    module: nn.Module, pre: Callable[..., None], post: Callable[..., None]
) -> Any:
    """Run ``pre`` and ``post`` (a module's scope hooks) around ``module``'s compiled call, outside the
    compiled frame; returns the compiled call, for ``module_scopes`` to put back."""
    compiled: Callable[..., Any] = module._compiled_call_impl  # type: ignore[assignment]

    def call(*args: Any, **kwargs: Any) -> Any:
        pre(module, args, kwargs)
        output = None
        try:
            output = compiled(*args, **kwargs)
        finally:
            post(module, args, kwargs, output)
        return output

    module._compiled_call_impl = call
    return compiled


@contextmanager
def saved_tensor_tags(tracker: Tracker) -> Iterator[None]:
    """Tag every tensor autograd saves for backward as an activation of the module saving it.

    The pack hook keeps a detached view of the tensor: the same storage, held and freed when the real
    run holds and frees it. Not the tensor itself: a node saving its own output (a ReLU) would then hold
    the output, whose ``grad_fn`` is the node -- a cycle through C++ that nothing collects, which kept an
    intermediate alive after the real run freed it (``self.generated = self.g(z)``, never backwarded:
    +1.5 % in a GAN's second step). Without hooks autograd saves outputs without that reference.
    """

    def pack(t: Tensor) -> Tensor:
        handle = tracker.handle_of(t)
        if handle is not None:
            tracker.events.append(Tag(handle, Role.ACTIVATION, tracker.module))
        # (A real tensor -- a packed sequence's batch sizes, which kernels read through a pointer -- has
        # no graph to cycle through, and must stay real: detaching it in the fake mode would fake it.)
        return t.detach() if isinstance(t, FakeTensor) and t.grad_fn is not None else t

    def unpack(t: Tensor) -> Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), warnings.catch_warnings():
        # These hooks are the simulation's, not the user's: torch's notice that selective checkpointing
        # bypasses saved-tensor hooks (it still tells the hooks nothing, so those saves are untagged)
        # is not the user's business.
        warnings.filterwarnings("ignore", message="A saved_tensors_hooks context", category=FutureWarning)
        yield
