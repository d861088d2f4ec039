"""Process groups and device meshes of the fake backend, and what must not mix them with real ones.

A simulation's groups are PyTorch's fake backend (``torch.testing._internal.distributed.fake_pg``):
made without a collective, entered into c10d's registries by hand where device meshes look their
groups up (:func:`registered_group`), and taken out again. Device meshes made while the fake mode runs
are made on real tensors of ranks (:func:`real_meshes`); DTensor's sharding caches, which take a fake
mesh for a real one of the same layout, are emptied around a simulation (:func:`clear_sharding_caches`);
DTensor's shape propagation on global fake tensors is kept out of the event stream
(:func:`untracked_sharding_propagation`).

Example:
    >>> import torch.testing._internal.distributed.fake_pg  # noqa: F401  (the "fake" backend)
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> with registered_group(1, [0, 1, 2, 3], FakeStore()) as group:
    ...     group.rank(), group.size()
    (1, 4)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = [
    "clear_sharding_caches",
    "real_meshes",
    "registered_group",
    "unregistered_group",
    "untracked_sharding_propagation",
]


@contextlib.contextmanager
def real_meshes() -> Iterator[None]:
    """Device meshes made inside the simulation (a plan's ``mesh["data_parallel"]``, FSDP2's
    concatenation of its mesh with a parameter's tensor-parallel one) are made on real tensors of
    ranks: under the fake mode a new mesh's tensor would be fake, its ranks unknown, and finding this
    rank in it (``(mesh == rank).nonzero()``) reads values."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # no device meshes in this build
        yield
        return
    names = [n for n in ("__init__", "__getitem__", "_flatten", "_unflatten") if n in vars(DeviceMesh)]
    originals = {n: vars(DeviceMesh)[n] for n in [*names, "_concatenate"] if n in vars(DeviceMesh)}

    def real(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return method(*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name, original in originals.items():
            static = isinstance(original, staticmethod)
            made = staticmethod(real(original.__func__)) if static else real(original)
            stack.enter_context(mock.patch.object(DeviceMesh, name, made))
        yield


def clear_sharding_caches() -> None:
    """Empty DTensor's sharding-propagation caches. Device meshes compare equal by their layout and
    dimension names, not their groups: a fake mesh of a job's sizes equals the job's own, and the
    caches would hand the output specs -- their mesh with them -- of the simulation to the real run
    (which then all-reduced on a fake group, seen) and the real run's to the simulation."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # no DTensor in this build, or no caches to clear
        return
    _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def registered_group(rank: int, ranks: list[int], store: Any) -> Iterator[Any]:
    """A fake group over the global ``ranks`` (``rank`` is this process's place in it) that the
    registries know -- a device mesh looks its ranks up there, functional collectives its name --
    entered by hand rather than with ``new_group`` (a collective), and taken out again on exit."""
    from torch.distributed import distributed_c10d as c10d

    group = unregistered_group(rank, len(ranks), store)
    name: Any = f"memest_fake_{id(group)}"  # a GroupName
    group._set_group_name(name)
    world = c10d._world
    tag = f"ptd:{name}"
    world.pg_map[group] = ("fake", store)
    world.pg_names[group] = name
    world.pg_group_ranks[group] = {g: r for r, g in enumerate(ranks)}
    world.pg_backend_config[group] = "fake"
    world.tags_to_pg.setdefault(tag, []).append(group)
    world.pg_to_tag[group] = tag
    torch._C._distributed_c10d._register_process_group(name, group)
    try:
        yield group
    finally:
        torch._C._distributed_c10d._unregister_process_group(name)
        for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config):
            table.pop(group, None)
        world.pg_to_tag.pop(group, None)
        world.tags_to_pg.pop(tag, None)


def unregistered_group(rank: int, world_size: int, store: Any) -> Any:
    """A ``ProcessGroup`` over the fake backend that no registry knows (as ``init_process_group``
    assembles one, without the bookkeeping)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    dist = torch.distributed
    group = dist.ProcessGroup(store, rank, world_size)
    backend = FakeProcessGroup._create_internal(rank, world_size)
    kind = dist.ProcessGroup.BackendType.CUSTOM
    for device in ("cpu", "cuda"):  # fake CUDA tensors on a GPU machine
        group._register_backend(torch.device(device), kind, backend)
    group._set_default_backend(kind)
    return group


@contextlib.contextmanager
def untracked_sharding_propagation(
    untracked: Callable[[], contextlib.AbstractContextManager[None]],
) -> Iterator[None]:
    """DTensor works out an op's output shape by running it on fake tensors of the *global* shape, in
    whatever fake mode is active -- the simulation's. Those runs allocate nothing on a real rank:
    ``untracked()`` keeps them out of the event stream."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # no DTensor in this build: nothing to hide
        yield
        return
    name = "_propagate_tensor_meta_non_cached"
    original = getattr(ShardingPropagator, name, None)
    if original is None:
        yield
        return

    def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with untracked():
            return original(self, *args, **kwargs)

    setattr(ShardingPropagator, name, propagate)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)
