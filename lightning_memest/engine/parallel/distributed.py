"""Data and tensor parallelism as one rank sees it: PyTorch's own DDP, FSDP2 and DTensor styles over
fake process groups.

A strategy (:class:`DDP`, :class:`FSDP`, :class:`TP`, :class:`ModelParallel`) says how a model is
wrapped for a given world size; :func:`wrap` wraps it with PyTorch's real classes
(``DistributedDataParallel``, ``fully_shard``, the job's ``parallelize_module`` plan), the
same way for a simulation on fake tensors and for a real, measured run. In a simulation the process
group is the fake one PyTorch ships for its tests (``torch.testing._internal.distributed.fake_pg``):
collectives return at once and move no data. That is all a memory estimate needs: every buffer DDP and
FSDP allocate -- gradient buckets, sharded parameters, all-gathered units, reduce-scatter inputs -- is
allocated by their own code, exactly as on a real rank; what gloo allocates inside a collective on a
CPU job is a kernel model of the collective's op (``accounting/kernels/cpu_collectives.py``).

What the fake run has to be helped with (all of it about data a fake tensor does not have):
DDP's construction-time check that all ranks hold the same shapes (it reads the tensors), its
first-step re-bucketing (it exchanges bucket indices as tensor data: skipped, the buckets keep their
initial layout, the same bytes), and its all-reduce, whose fake future carries no tensor (a comm hook
returns the bucket itself, which is what the in-place all-reduce leaves).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_memest import estimate_step
    >>> from lightning_memest.engine.parallel.distributed import FSDP
    >>> model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    >>> est = estimate_step(model, torch.randn(8, 256), optimizer=torch.optim.Adam,
    ...                     strategy=FSDP(world_size=4, units=("Linear",)))
    >>> est.steady_state.breakdown.parameters  # each rank holds a quarter of 2 * (256 * 256 + 256) floats
    131584
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from lightning_memest.constants import STRATEGIES
from lightning_memest.engine.parallel.fake_groups import (
    clear_sharding_caches,
    real_meshes,
    registered_group,
    unregistered_group,
)
from lightning_memest.engine.parallel.pipeline import PIPELINE_MESH_DIMS, Pipeline, works_hold_their_tensors
from lightning_memest.errors import EstimationError
from lightning_memest.options import check_count

__all__ = [
    "DDP",
    "FSDP",
    "MESH_DIMS",
    "STRATEGIES",
    "TP",
    "BufferListener",
    "ModelParallel",
    "Pipeline",
    "Strategy",
    "fake_process_group",
    "fsdp_units",
    "pipeline_parts",
    "shard_units",
    "unsharded_buffers",
    "wrap",
]

#: Called with storages that belong to data parallelism (buckets, unsharded parameters), to tag them.
BufferListener = Callable[[list[Tensor]], None]

_group: ContextVar[Any] = ContextVar("memest_fake_group", default=None)


@dataclass(frozen=True)
class DDP:
    """``DistributedDataParallel`` on ``world_size`` ranks, seen from rank ``rank``.

    ``bucket_cap_mb`` and ``gradient_as_bucket_view`` are DDP's own arguments (Lightning passes them
    through ``DDPStrategy(**kwargs)``). Without ``gradient_as_bucket_view`` DDP keeps a bucket copy of
    every gradient: the parameters' size again, on every rank.
    """

    world_size: int
    rank: int = 0
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False

    def __post_init__(self) -> None:
        _check_ranks(self.world_size, self.rank)
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be more than 0; got {self.bucket_cap_mb}")


@dataclass(frozen=True)
class FSDP:
    """FSDP2 (``fully_shard``) on ``world_size`` ranks, seen from rank ``rank``.

    ``units`` names the module classes sharded as units (each instance gets ``fully_shard``, inner ones
    first, then the root); ``None`` shards each block of every ``nn.ModuleList`` (the transformer
    layers, as torchtitan and Lightning's examples do) and then the root. ``param_dtype`` and
    ``reduce_dtype`` are the ``MixedPrecisionPolicy``; ``reshard_after_forward`` as in ``fully_shard``:
    ``None`` (its default) reshards every unit after forward but a root, which keeps its parameters
    gathered for backward. ``kept_gathered`` names units (their paths in the model, ``"blocks.11"``)
    given ``reshard_after_forward=False`` alone: the common recipe leaves the last block gathered, since
    backward needs it first.

    >>> FSDP(8, kept_gathered=("layers.31",)).kept_gathered
    ('layers.31',)
    """

    world_size: int
    rank: int = 0
    units: tuple[str | type[nn.Module], ...] | None = None
    reshard_after_forward: bool | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    kept_gathered: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_ranks(self.world_size, self.rank)
        if isinstance(self.kept_gathered, str) or not all(isinstance(p, str) for p in self.kept_gathered):
            raise ValueError(f"kept_gathered must be a tuple of module paths; got {self.kept_gathered!r}")


@dataclass(frozen=True)
class TP:
    """Tensor parallelism on ``world_size`` ranks, seen from rank ``rank``: ``plan(model, mesh)``
    parallelises the model on a 1-D device mesh as the job does -- ``parallelize_module`` with its
    ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` styles, or the job's own function
    (torchtitan's ``apply_tp``, a ``configure_model``'s part).

    >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    >>> styles = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    >>> TP(2, plan=lambda model, mesh: parallelize_module(model, mesh, styles)).world_size
    2
    """

    world_size: int
    plan: Callable[[nn.Module, Any], Any]
    rank: int = 0

    def __post_init__(self) -> None:
        _check_ranks(self.world_size, self.rank)
        if not callable(self.plan):
            raise TypeError(f"TP(plan=...) must be callable as plan(model, mesh); got {self.plan!r}")


@dataclass(frozen=True)
class ModelParallel:
    """Lightning's ``ModelParallelStrategy``: ``data_parallel`` x ``tensor_parallel`` ranks on a 2-D
    device mesh, seen from rank ``rank``. ``plan(model, mesh)`` is what ``configure_model`` does with
    ``self.device_mesh``: tensor parallelism on ``mesh["tensor_parallel"]`` (``parallelize_module``),
    then ``fully_shard`` on ``mesh["data_parallel"]`` -- torchtitan's ``parallelize`` takes the same
    mesh. Ranks are laid out as Lightning's mesh lays them: rank = data-parallel index x
    ``tensor_parallel`` + tensor-parallel index.

    >>> from torch.distributed.fsdp import fully_shard
    >>> def plan(model, mesh):
    ...     fully_shard(model, mesh=mesh["data_parallel"])
    >>> ModelParallel(2, 4, plan=plan, rank=5).world_size
    8
    """

    data_parallel: int
    tensor_parallel: int
    plan: Callable[[nn.Module, Any], Any]
    rank: int = 0

    def __post_init__(self) -> None:
        check_count("data_parallel", self.data_parallel)
        check_count("tensor_parallel", self.tensor_parallel)
        _check_ranks(self.world_size, self.rank)
        if not callable(self.plan):
            raise TypeError(
                f"ModelParallel(plan=...) must be callable as plan(model, mesh); got {self.plan!r}"
            )

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.tensor_parallel

    def groups(self) -> tuple[tuple[int, list[int]], tuple[int, list[int]]]:
        """This rank's place in its data-parallel and tensor-parallel groups: (its rank in the group,
        the group's global ranks) for each, in the mesh's row-major layout."""
        dp_index, tp_index = divmod(self.rank, self.tensor_parallel)
        data = [d * self.tensor_parallel + tp_index for d in range(self.data_parallel)]
        tensor = [dp_index * self.tensor_parallel + t for t in range(self.tensor_parallel)]
        return (dp_index, data), (tp_index, tensor)


#: The mesh dimensions of :class:`ModelParallel`, named as Lightning's ``ModelParallelStrategy`` names them.
MESH_DIMS = ("data_parallel", "tensor_parallel")

Strategy = DDP | FSDP | TP | ModelParallel | Pipeline


def _check_ranks(world_size: int, rank: int) -> None:
    check_count("world_size", world_size)
    check_count("rank", rank, minimum=0)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}); got {rank}")


def _dist() -> Any:
    if not torch.distributed.is_available():
        raise EstimationError("this PyTorch build has no torch.distributed: DDP/FSDP cannot be simulated")
    return torch.distributed


@contextlib.contextmanager
def fake_process_group(strategy: Strategy) -> Iterator[None]:
    """A fake process group of the strategy's world size for :func:`wrap` to use inside the block
    (with :class:`ModelParallel`, its data- and tensor-parallel groups too).

    Without a process group in this process, the default one is created (backend ``fake``, this
    rank) and destroyed on exit. Inside a real distributed job (the callback) no group is made with
    ``new_group``: that is a collective, which ranks that estimate at different moments (a batch-size
    search on one rank only) would deadlock on. DDP gets a group no registry knows; FSDP, TP and
    ModelParallel, whose device meshes look their groups up, ones entered into the registries by hand
    for the time of the block.
    """
    dist = _dist()
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with contextlib.ExitStack() as stack:
        world = list(range(strategy.world_size))
        if not dist.is_initialized():
            dist.init_process_group(
                "fake", store=FakeStore(), rank=strategy.rank, world_size=strategy.world_size
            )
            stack.callback(dist.destroy_process_group)
            groups = [dist.group.WORLD]
        elif isinstance(strategy, DDP):
            groups = [unregistered_group(strategy.rank, strategy.world_size, FakeStore())]
        else:  # a device mesh looks its group up
            if dist.get_rank() != strategy.rank or dist.get_world_size() != strategy.world_size:
                raise EstimationError(
                    f"inside a job of {dist.get_world_size()} ranks (this is rank {dist.get_rank()}), "
                    f"{type(strategy).__name__} can be simulated only for this rank of this job, not "
                    f"rank {strategy.rank} of {strategy.world_size}; estimate in a process without a "
                    "process group"
                )
            groups = [stack.enter_context(registered_group(strategy.rank, world, FakeStore()))]
        if isinstance(strategy, ModelParallel) or (isinstance(strategy, Pipeline) and strategy.plan):
            for rank, ranks in strategy.groups():
                groups.append(stack.enter_context(registered_group(rank, ranks, FakeStore())))
        if isinstance(strategy, Pipeline):
            stack.enter_context(works_hold_their_tensors(tuple(groups)))
        stack.enter_context(real_meshes())
        token = _group.set(tuple(groups))
        clear_sharding_caches()
        try:
            yield
        finally:
            _group.reset(token)
            clear_sharding_caches()


def wrap(model: nn.Module, strategy: Strategy, on_buffers: BufferListener | None = None) -> nn.Module:
    """``model`` wrapped by ``strategy`` with PyTorch's classes: the module a training step calls.

    The process group is the fake one inside :func:`fake_process_group`, else the default (real) one.
    Under FSDP the model itself becomes the sharded module (``fully_shard`` works in place).
    """
    if isinstance(strategy, Pipeline):
        raise EstimationError(
            "Pipeline parallelism is simulated for training steps (estimate_step's loop='train'): its "
            "schedule runs forward and backward together"
        )
    groups = _groups(strategy)
    group = groups[0]
    fake = any(isinstance(p, FakeTensor) for p in model.parameters())
    if isinstance(strategy, DDP):
        return _ddp(model, strategy, group, fake, on_buffers)
    if isinstance(strategy, TP):
        return _tp(model, strategy, group)
    if isinstance(strategy, ModelParallel):
        return _model_parallel(model, strategy, groups, on_buffers)
    return _fsdp(model, strategy, group, on_buffers)


def pipeline_parts(
    model: nn.Module, strategy: Pipeline, on_buffers: BufferListener | None
) -> tuple[Any, Callable[[nn.Module], None] | None]:
    """The pipeline's process group for ``strategy`` (the fake one inside :func:`fake_process_group`,
    else the default one), and with a ``plan`` what parallelises each stage: the plan on the job's
    3-D mesh's data- and tensor-parallel dimensions, its FSDP units tagging their gathered weights."""
    groups = _groups(strategy)
    plan = strategy.plan
    if plan is None:
        return groups[0], None
    shape = (strategy.stages, strategy.data_parallel, strategy.tensor_parallel)
    mesh = _job_mesh(model, groups, shape, PIPELINE_MESH_DIMS)
    with unset_fake_temporarily():  # sliced by the values of its ranks
        inner, group = mesh[MESH_DIMS], mesh["pipeline"].get_group()
    return group, lambda stage: _planned(stage, plan, inner, on_buffers)


def _groups(strategy: Strategy) -> tuple[Any, ...]:
    groups = _group.get() or (_dist().group.WORLD,)
    if groups[0] is None:
        raise EstimationError(
            f"{type(strategy).__name__} needs a process group: call init_process_group first"
        )
    return groups


def _tp(model: nn.Module, strategy: TP, group: Any) -> nn.Module:
    """``strategy.plan`` on a 1-D mesh over ``group``: the parameters become ``DTensor`` shards of this
    rank, and the styles' hooks redistribute activations with functional collectives."""
    strategy.plan(model, _mesh(model, group))
    return model


def _model_parallel(
    model: nn.Module, strategy: ModelParallel, groups: tuple[Any, ...], on_buffers: BufferListener | None
) -> nn.Module:
    """``strategy.plan`` on a 2-D mesh over the data- and tensor-parallel groups (a job's own
    ``configure_model``); the units it sharded with ``fully_shard`` tag their gathered weights."""
    shape = (strategy.data_parallel, strategy.tensor_parallel)
    _planned(model, strategy.plan, _job_mesh(model, groups, shape, MESH_DIMS), on_buffers)
    return model


def _job_mesh(
    model: nn.Module, groups: tuple[Any, ...], shape: tuple[int, ...], names: tuple[str, ...]
) -> Any:
    """The job's device mesh of ``shape`` and dimension ``names``, of the model's device: in a real job
    (a measured run; ``groups`` is the default group alone) as Lightning and torchtitan build it, its
    groups made; in a simulation over the fake groups ``groups[1:]``, one per dimension."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    device_type = _device_type(model)
    with unset_fake_temporarily():  # the mesh is a small real tensor of ranks
        if len(groups) == 1:
            return init_device_mesh(device_type, shape, mesh_dim_names=names)
        layout = torch.arange(math.prod(shape)).view(shape)
        return DeviceMesh.from_group(list(groups[1:]), device_type, mesh=layout, mesh_dim_names=names)


def _planned(
    module: nn.Module, plan: Callable[[nn.Module, Any], Any], mesh: Any, on_buffers: BufferListener | None
) -> None:
    """``plan(module, mesh)`` (a job's ``configure_model`` body); the units it sharded with
    ``fully_shard`` tag their gathered weights."""
    from torch.distributed.fsdp import FSDPModule

    plan(module, mesh)
    _tag_gathered([m for m in module.modules() if isinstance(m, FSDPModule)], on_buffers)


def _mesh(model: nn.Module, group: Any) -> Any:
    """A 1-D device mesh over ``group``, of the device the model's parameters are on."""
    from torch.distributed.device_mesh import DeviceMesh

    with unset_fake_temporarily():  # the mesh is a small real tensor of ranks, read by its constructor
        return DeviceMesh.from_group(group, _device_type(model))


def _device_type(model: nn.Module) -> str:
    """The type of the device the model's parameters are on (a mesh's device type)."""
    return next((p.device.type for p in model.parameters()), "cpu")


def _ddp(
    model: nn.Module, strategy: DDP, group: Any, fake: bool, on_buffers: BufferListener | None
) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.parallel import distributed as ddp_module

    dist = _dist()

    options: dict[str, Any] = {
        "process_group": group,
        "bucket_cap_mb": strategy.bucket_cap_mb,
        "gradient_as_bucket_view": strategy.gradient_as_bucket_view,
    }
    if not fake:
        return DistributedDataParallel(model, **options)
    name = "_verify_param_shape_across_processes"  # reads tensor data
    check = getattr(ddp_module, name)
    setattr(ddp_module, name, lambda *args, **kwargs: None)
    try:
        # init_sync=False: the broadcast of the initial weights moves data, and its coalescing buffer is
        # a transient of construction, before any step.
        wrapped = DistributedDataParallel(model, init_sync=False, **options)
    finally:
        setattr(ddp_module, name, check)
    # DDP checks a hook's annotations as objects; this module's are strings (postponed evaluation).
    _bucket_allreduce.__annotations__.update(
        bucket=dist.GradBucket, **{"return": torch.futures.Future[Tensor]}
    )
    wrapped.register_comm_hook(on_buffers, _bucket_allreduce)
    wrapped.reducer = _KeepBuckets(wrapped.reducer)  # type: ignore[assignment]
    return wrapped


def _bucket_allreduce(on_buffers: BufferListener | None, bucket: Any) -> torch.futures.Future[Tensor]:
    """The all-reduce of a fake run: the bucket, reduced in place (no data moves, no memory either)."""
    buffer: Tensor = bucket.buffer()
    if on_buffers is not None:
        on_buffers([buffer])
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


class _KeepBuckets:
    """DDP's reducer, without the re-bucketing after the first step (it exchanges indices as tensor
    data). The buckets keep their first layout: the same parameters, so the same bytes."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _fsdp(model: nn.Module, strategy: FSDP, group: Any, on_buffers: BufferListener | None) -> nn.Module:
    shard_units(model, strategy, _mesh(model, group), on_buffers)
    return model


def shard_units(
    model: nn.Module, strategy: FSDP, mesh: Any, on_buffers: BufferListener | None = None
) -> None:
    """``fully_shard`` on each of ``strategy``'s units (:func:`fsdp_units`, inner ones first), then on
    the root, over ``mesh``, with its policy and resharding; the units named in its ``kept_gathered``
    alone keep their parameters gathered after forward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    units = [*fsdp_units(model, strategy.units), model]
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": strategy.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=strategy.param_dtype, reduce_dtype=strategy.reduce_dtype
        ),
    }
    paths = {id(m): name for name, m in model.named_modules()}
    unknown = set(strategy.kept_gathered) - {paths[id(u)] for u in units}
    if unknown:
        named = ", ".join(repr(paths[id(u)]) for u in units[:-1][:8])
        raise EstimationError(
            f"FSDP kept_gathered: {', '.join(sorted(map(repr, unknown)))} is not a unit of the model "
            f"(its units: {named}{', ...' if len(units) > 9 else ''})"
        )
    for unit in units:
        kept = paths[id(unit)] in strategy.kept_gathered
        fully_shard(unit, **{**options, "reshard_after_forward": False} if kept else options)
    _tag_gathered(units, on_buffers)


def _tag_gathered(units: list[nn.Module], on_buffers: BufferListener | None) -> None:
    """Each unit tags its own gathered weights when its forward ends -- also where forward is not
    called on the root (Lightning calls training_step)."""
    if on_buffers is not None:
        for unit in units:
            unit.register_forward_hook(lambda m, *_: on_buffers(unsharded_buffers(m)), always_call=True)


def fsdp_units(model: nn.Module, units: tuple[str | type[nn.Module], ...] | None) -> list[nn.Module]:
    """The submodules to shard as units, inner ones first (``fully_shard`` goes bottom-up)."""
    if units is None:
        chosen = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    else:
        names = {u for u in units if isinstance(u, str)}
        types = tuple(u for u in units if isinstance(u, type))
        chosen = [m for m in model.modules() if isinstance(m, types) or type(m).__name__ in names]
        missing = names - {type(m).__name__ for m in chosen}
        if missing:
            raise EstimationError(
                f"FSDP units: the model has no module of class {', '.join(sorted(missing))}"
            )
    seen: set[int] = set()
    ordered = []
    for m in reversed(chosen):  # modules() is pre-order: reversed, children come before parents
        if m is not model and id(m) not in seen:
            seen.add(id(m))
            ordered.append(m)
    return ordered


def unsharded_buffers(unit: nn.Module) -> list[Tensor]:
    """The all-gather outputs FSDP keeps per parameter of one unit (its unsharded weights, freed by
    resizing their storage to 0 between uses). FSDP2 internals, read defensively: none found means no
    tags."""
    get_state = getattr(unit, "_get_fsdp_state", None)
    group = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
    return [
        t
        for fsdp_param in getattr(group, "fsdp_params", ())
        for t in getattr(fsdp_param, "all_gather_outputs", ())
        if isinstance(t, Tensor)
    ]
