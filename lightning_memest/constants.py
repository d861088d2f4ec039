"""The named choices and defaults of a step, without torch: precisions, losses, optimizers, strategies,
loops, the profile's sort orders and the batch-size search's cap.

The ``memest`` parser builds its ``choices`` and defaults from these, so ``memest --help``, ``--version``
and a usage error answer without importing torch (which costs seconds). The modules that use them with
torch (``engine.step``, ``cases``, ``search``, ...) take them from here: one definition each.

Example:
    >>> PRECISIONS
    ('32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true')
    >>> DEFAULT_OPTIMIZER in OPTIMIZERS and DEFAULT_LOSS in LOSSES
    True
"""

from __future__ import annotations

from typing import Final, Literal, get_args

__all__ = [
    "COMPILE_MODES",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_CAP",
    "DEFAULT_LOSS",
    "DEFAULT_OPTIMIZER",
    "LOOPS",
    "LOSSES",
    "MODULE_ORDERS",
    "NODE_ORDERS",
    "OPTIMIZERS",
    "PIPELINE_SCHEDULES",
    "PRECISIONS",
    "STRATEGIES",
    "LossName",
    "OptimizerName",
    "PlainLoop",
    "Precision",
]

#: Lightning's precision names that a step accepts.
Precision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

#: ``torch.compile`` modes a case can be compiled with (``memest ... --compile MODE``): those without
#: CUDA graphs, which a step on fake tensors cannot capture.
COMPILE_MODES: Final[tuple[str, ...]] = ("default", "max-autotune-no-cudagraphs")

#: The losses and optimizers of a case (``cases.build_case``) by name.
LossName = Literal["cross_entropy", "sum"]
OptimizerName = Literal["sgd", "adam", "adamw", "none"]
LOSSES: tuple[str, ...] = get_args(LossName)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)

#: Small enough to estimate and measure most vision models on a laptop CPU in seconds.
DEFAULT_BATCH_SIZE = 8
DEFAULT_LOSS: LossName = "cross_entropy"
#: Adam, because it is what most training runs use and because its state (two buffers per parameter,
#: created inside the first ``step()``) is what makes the first step differ from the steady state.
DEFAULT_OPTIMIZER: OptimizerName = "adam"

#: The data-parallel strategies simulated on a fake process group (``engine.parallel.distributed``).
STRATEGIES = ("ddp", "fsdp")

#: The pipeline schedules simulated (``engine.parallel.pipeline``), by the names of
#: ``torch.distributed.pipelining``'s classes (``ScheduleGPipe``, ``Schedule1F1B``, ...).
PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)

#: What a plain model's batch does: a training step, a validation batch, a predict batch.
PlainLoop = Literal["train", "validate", "predict"]
LOOPS: tuple[PlainLoop, ...] = get_args(PlainLoop)

#: The largest batch size the search considers: far beyond any real batch, small enough that the
#: bisection ends in at most 20 steps.
DEFAULT_CAP = 2**20

#: ``by`` values of ``GraphProfile.table`` / ``GraphProfile.rows``: ``graph`` keeps the graph's order;
#: the others sort by that figure, largest first.
NODE_ORDERS: Final = (
    "graph",
    "saved",
    "fwd_in",
    "fwd_tmp",
    "fwd_out",
    "bwd_tmp",
    "bwd_out",
    "flops",
    "fwd_flops",
    "bwd_flops",
)

#: ``by`` values of ``tables.module_rows`` / ``tables.module_table``: ``tree`` is depth-first module order.
MODULE_ORDERS: Final = ("tree", "saved", "parameters", "forward_peak", "backward_peak", "flops")
