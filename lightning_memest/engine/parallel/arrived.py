"""A module that arrives parallelised -- Lightning's ``ModelParallelStrategy`` has run the job's
``configure_model`` (``parallelize_module``, ``fully_shard``) before fit starts -- read back as a
strategy that redoes the same on fake tensors, and undone for the time of the simulation.

Why redo rather than run the parallelised module as it is: its parameters are shards on a real process
group, and FSDP's collectives run on that group's objects, which a fake tensor cannot go through. So
the simulation takes the module whole (each sharded parameter faked at its global shape), removes what
``fully_shard`` attached to it, and does the job's parallelisation again on a fake mesh of the job's
sizes, as this rank:

- each parameter split over the tensor-parallel dimension is distributed again with the placements it
  arrived with (``ColwiseParallel``'s ``Shard(0)``, ``RowwiseParallel``'s ``Shard(1)``, a
  ``distribute_tensor`` by hand alike);
- the forward hooks the styles registered (their input and output redistributions, whatever the style:
  ``SequenceParallel``, ``PrepareModuleInput``...) are run as they are, their code and layouts the
  job's, with the device mesh they close over swapped for the fake one of the same dimension names;
- FSDP2's units, mixed-precision policy and resharding (:func:`fsdp_like`) are applied again over the
  fake data-parallel dimension.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4))
    >>> fsdp_like(model) is None and mesh_hooks(model) == []
    True
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_memest.engine.parallel.distributed import (
    FSDP,
    MESH_DIMS,
    ModelParallel,
    shard_units,
)
from lightning_memest.errors import EstimationError

__all__ = [
    "ArrivedPlan",
    "arrived_model_parallel",
    "fsdp_like",
    "mesh_hooks",
    "strip_fully_shard",
]


def fsdp_like(model: nn.Module) -> FSDP | None:
    """The FSDP2 sharding a module arrived with (``fully_shard`` already applied, as Lightning's
    ModelParallelStrategy does in ``configure_model``), as a strategy that redoes it: the classes of
    its units, the mixed-precision policy and resharding of its root unit, the size of its
    (data-parallel) mesh and this rank's place in it. ``None`` when the module is not sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        return None
    state = sharded[0]._get_fsdp_state()
    group = state._fsdp_param_group
    if group is None:  # a root unit with no parameters of its own: read a unit that has some
        group = next(g for m in sharded if (g := m._get_fsdp_state()._fsdp_param_group) is not None)
    mesh = group.mesh_info.mesh
    if mesh.ndim != 1:
        raise EstimationError("FSDP on a mesh of more than one dimension (HSDP) is not simulated")
    policy = state._mp_policy
    reshard = None if state._auto_reshard_after_forward else group.post_forward_mesh_info is not None
    # Units left gathered alone (the recipe's last block) where the others reshard
    paths = {id(m): name for name, m in model.named_modules()}
    kept = tuple(
        paths[id(m)]
        for m in sharded
        if m is not model
        and reshard is not False
        and (g := m._get_fsdp_state()._fsdp_param_group) is not None
        and g.post_forward_mesh_info is None
    )
    return FSDP(
        mesh.size(),
        rank=mesh.get_local_rank(),
        units=tuple(dict.fromkeys(_original_class(m) for m in sharded)),
        reshard_after_forward=reshard,
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        kept_gathered=kept,
    )


def strip_fully_shard(model: nn.Module) -> None:
    """Undo what ``fully_shard`` did to ``model``'s modules (their class, FSDP's forward hooks, the
    composable-API registries) so that the simulation can shard them again, on fake tensors.

    Only inside ``engine.fake.fake_module``, which puts every bit of it back on exit (and has already
    swapped the sharded parameters for whole fake ones).
    """
    try:
        from torch.distributed import _composable_state
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return
    for m in list(model.modules()):
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        m.__class__ = _original_class(m)  # type: ignore[assignment]
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key, hook in list(hooks.items()):
                if getattr(hook, "__self__", None) is state:
                    del hooks[key]
        for value in vars(m).values():  # contract's registry and state dicts
            if isinstance(value, dict):
                for key in [k for k, v in value.items() if isinstance(v, FSDPState) or k == "fully_shard"]:
                    del value[key]
        _composable_state._module_state_mapping.pop(m, None)


def _original_class(m: nn.Module) -> type[nn.Module]:
    """The class ``fully_shard`` derived ``FSDP<Class>`` from (its bases are ``(FSDPModule, Class)``)."""
    cls = type(m)
    base: type[nn.Module] = cls.__bases__[-1]
    return base


def mesh_hooks(model: nn.Module) -> list[tuple[str, str, int]]:
    """The forward (pre-)hooks of ``model``'s modules that close over a device mesh (those
    ``parallelize_module``'s styles registered: their input and output redistributions), as (module
    path, ``"pre"`` or ``"post"``, hook key) in each module's order."""
    found = []
    for path, module in model.named_modules():
        for kind, hooks in (("pre", module._forward_pre_hooks), ("post", module._forward_hooks)):
            found += [(path, kind, key) for key, hook in hooks.items() if _mesh_cells(hook)]
    return found


def _mesh_cells(hook: Any) -> list[int]:
    """The indices of ``hook``'s closure cells that hold a ``DeviceMesh``."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return []
    cells = getattr(hook, "__closure__", None) or ()
    return [i for i, c in enumerate(cells) if isinstance(_contents(c), DeviceMesh)]


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _on_mesh(hook: Any, mesh: Any) -> Any:
    """A copy of ``hook`` whose device meshes are the equivalents in ``mesh`` (the one of the same
    dimension names): the same code and the same layouts, on the fake groups."""
    cells = list(hook.__closure__)
    for i in _mesh_cells(hook):
        cells[i] = types.CellType(_equivalent(_contents(cells[i]), mesh))
    copy = types.FunctionType(hook.__code__, hook.__globals__, hook.__name__, hook.__defaults__, tuple(cells))
    copy.__kwdefaults__ = hook.__kwdefaults__
    return copy


def _equivalent(real: Any, mesh: Any) -> Any:
    names = tuple(real.mesh_dim_names or ())
    if names == tuple(mesh.mesh_dim_names):
        return mesh
    if names and set(names) <= set(mesh.mesh_dim_names):
        return mesh[names if len(names) > 1 else names[0]]
    raise EstimationError(
        f"a tensor-parallel hook runs on a device mesh of dimensions {names or '(unnamed)'}: only meshes "
        f"of ModelParallelStrategy's {MESH_DIMS} are simulated"
    )


def _tensor_placements(p: Any) -> tuple[Any, ...] | None:
    """How a parameter that arrived sharded is split over the tensor-parallel dimension (its
    placements there; ``None`` where it is not split over it): FSDP's shards over the data-parallel
    dimension are redone by :func:`fsdp_like`'s strategy."""
    spec = getattr(p, "_spec", None)
    names = tuple(getattr(getattr(spec, "mesh", None), "mesh_dim_names", None) or ())
    if spec is None or "tensor_parallel" not in names:
        return None
    return (spec.placements[names.index("tensor_parallel")],)


@dataclass(frozen=True)
class ArrivedPlan:
    """A job's ``configure_model`` as the module it left shows it, callable as ``plan(model, mesh)``
    on a fake :class:`ModelParallel` mesh: each tensor-parallel parameter distributed again with its
    placements, the styles' hooks rebound to the fake mesh, then FSDP2's units and options.

    Applied to the module inside the simulation (``engine.fake.fake_module`` puts its parameters and
    hooks back on exit)."""

    placements: tuple[tuple[str, tuple[Any, ...]], ...]
    hooks: tuple[tuple[str, str, int], ...]
    fsdp: FSDP | None

    def __call__(self, model: nn.Module, mesh: Any) -> None:
        from torch.distributed.tensor import distribute_tensor

        tensor_mesh = mesh["tensor_parallel"]
        for name, placements in self.placements:
            path, _, leaf = name.rpartition(".")
            owner = model.get_submodule(path)
            whole = owner._parameters[leaf]
            assert whole is not None
            shard = distribute_tensor(whole.detach(), tensor_mesh, list(placements))
            owner._parameters[leaf] = nn.Parameter(shard, requires_grad=whole.requires_grad)
        for path, kind, key in self.hooks:
            module = model.get_submodule(path)
            hooks = module._forward_pre_hooks if kind == "pre" else module._forward_hooks
            hooks[key] = _on_mesh(hooks[key], mesh)  # in place: the module's hook order is kept
        if self.fsdp is not None:
            shard_units(model, self.fsdp, mesh["data_parallel"])


def arrived_model_parallel(
    model: nn.Module, data_parallel: int, tensor_parallel: int, rank: int
) -> ModelParallel | None:
    """The strategy that redoes what a job's ``configure_model`` did to ``model`` on a
    ``data_parallel`` x ``tensor_parallel`` mesh, as rank ``rank``: a :class:`ModelParallel` with an
    :class:`ArrivedPlan` (tensor parallelism, FSDP2, or both); ``None`` when the module arrived as it
    was built."""
    fsdp = fsdp_like(model)
    placements = tuple(
        (name, found) for name, p in model.named_parameters() if (found := _tensor_placements(p)) is not None
    )
    hooks = tuple(mesh_hooks(model))
    if fsdp is None and not placements and not hooks:
        return None
    plan = ArrivedPlan(placements, hooks, fsdp)
    return ModelParallel(data_parallel, tensor_parallel, plan=plan, rank=rank)
