"""Compiled steps, simulated as ``torch.compile`` runs them, against the CPU profiler's allocator events.

The simulation compiles the user's code for real (dynamo, AOTAutograd and its partitioner, inductor) and
runs inductor's buffer plan on fake tensors (``engine.compiled``). Each test would fail on an eager
simulation: the compiled step's measured peak is far from the eager one (an activation budget), or the
fit's compile is checked to find the graphs the estimate compiled.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from cli_models import Block, Net
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from lightning_memest import MemEstimate, estimate_step
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step

TOLERANCE = 1.0  # per cent of the measured peak: the zoo's


def _loss(model: nn.Module, batch: Tensor) -> Tensor:
    loss: Tensor = model(batch).square().mean()
    return loss


def _error(estimated: int, measured: int) -> float:
    return 100.0 * (estimated - measured) / measured


def test_a_compiled_step_under_an_activation_budget_is_estimated_as_measured_and_compiled_once(
    tmp_path: Path,
) -> None:
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    torch.manual_seed(0)
    net, batch = Net(), torch.randn(8, 64, 128)
    config = StepConfig(loss_fn=_loss, optimizer=torch.optim.AdamW)
    eager = measure_step(copy.deepcopy(net), batch, config)
    # The compiler's own recompute under a budget (the partitioner's choice of what to save) and a
    # cold cache: the estimate compiles first, the run's compile must find its graphs.
    with torch._functorch.config.patch(activation_memory_budget=0.5), temporary_cache_dir(str(tmp_path)):
        torch._dynamo.reset()
        counters.clear()  # what earlier tests in this process compiled
        compiled = torch.compile(net)
        est = estimate_step(compiled, batch, loss_fn=_loss, optimizer=torch.optim.AdamW)  # type: ignore[arg-type]
        assert dict(counters["frames"]) == {} and dict(counters["aot_autograd"]) == {}  # nothing left
        measured = measure_step(compiled, batch, config)
        run = dict(counters["aot_autograd"])
    assert est.compiled == ("",) and est.compiled_eagerly is None
    assert 0.0 < est.compile_seconds <= est.estimate_seconds  # (inductor's compile, inside dynamo's, once)
    # (AOT ids number the process's graphs: "0_forward" alone, "3_forward" after other tests' compiles)
    kinds = [g.split("_", 1)[1] for g in est.compiled_graphs]
    assert kinds.count("forward") == 2 and kinds.count("backward") == 2, est.compiled_graphs
    pairs = ((est.first_step.bytes, measured.first_step), (est.steady_state.bytes, measured.steady_state))
    for e, m in pairs:
        assert abs(_error(e, m)) <= TOLERANCE, (e, m)
    # An eager simulation could not pass: the budget takes a quarter off the eager step's peak.
    assert _error(measured.steady_state, eager.steady_state) < -20.0
    assert run.get("autograd_cache_hit") == 1 and "autograd_cache_miss" not in run, run
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}  # what the run compiled, nothing more


def test_the_simulation_leaves_no_compiled_entry_behind() -> None:
    from torch._dynamo.eval_frame import _get_total_cache_entry_count

    block = Block()
    block.compile(backend="aot_eager")
    torch._dynamo.reset()
    estimate_step(block, torch.randn(2, 16, 128), optimizer=torch.optim.SGD)
    assert _get_total_cache_entry_count(Block.forward.__code__) == 0
    assert _get_total_cache_entry_count(nn.Module._call_impl.__code__) == 0


def test_a_failing_compile_is_simulated_eagerly_and_says_why() -> None:
    def broken(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
        raise RuntimeError("this backend cannot compile")

    torch.manual_seed(0)
    net, batch = Net(), torch.randn(4, 16, 128)
    eager = estimate_step(copy.deepcopy(net), batch, optimizer=torch.optim.SGD)
    est = estimate_step(torch.compile(net, backend=broken), batch, optimizer=torch.optim.SGD)  # type: ignore[arg-type]
    assert est.compiled_eagerly is not None and "its compile failed" in est.compiled_eagerly
    assert "this backend cannot compile" in est.compiled_eagerly
    assert est.steady_state.bytes == eager.steady_state.bytes
    assert "simulated eagerly" in str(est)


class _BlockwiseCompiled(pl.LightningModule):
    """The large-model recipe: each block compiled in place (``block.compile()``), the rest eager."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        for block in self.net.blocks:
            block.compile()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        return _loss(self.net, x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(callbacks: list[Any]) -> tuple[_BlockwiseCompiled, dict[str, int]]:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    module = _BlockwiseCompiled()
    data = DataLoader(TensorDataset(torch.randn(32, 64, 128, generator=torch.Generator().manual_seed(1))), 8)
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    return module, dict(counters["frames"])


def test_blockwise_compiled_fit_checks_itself_within_one_percent_and_trains_as_without() -> None:
    plain, plain_frames = _fit([])
    memest = MemEstimate(max_depth=0)
    watched, frames = _fit([memest])
    est = memest.estimate
    assert est is not None and est.compiled == ("net.blocks.0", "net.blocks.1")
    assert est.compiled_eagerly is None and est.compiled_graphs
    assert memest.measured and all(abs(m.error_pct) <= TOLERANCE for m in memest.measured), memest.measured
    assert frames == plain_frames
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)
    # The compiled blocks keep their names in the per-module figures (their scope is marked around the
    # compiled call, outside the graph).
    assert {"net.blocks.0", "net.blocks.1"} <= {m.path for m in est.modules.walk()}


def test_the_advice_for_a_compiled_step_over_its_budget_names_the_compilers_budget_that_fits() -> None:
    # What MemEstimate's pre-check offers (advice.advise): the highest activation_memory_budget whose
    # re-simulated step fits, tried from the least recompute down, each value announced (a recompile);
    # an eager step gets no such option. (The CLI's test measures the value offered.)
    from lightning_memest.accounting import capture_filter
    from lightning_memest.advice import advise
    from lightning_memest.engine.simulate import simulate
    from lightning_memest.search import BatchSizeResult
    from lightning_memest.search.sizing import SizedStep

    def layer() -> nn.Module:
        return nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128), nn.Tanh())

    def sized(model: nn.Module) -> SizedStep:
        config = StepConfig(optimizer=torch.optim.SGD)

        def run(batch: Any, *, flops: bool, calibrate: bool) -> Any:
            return simulate(model, batch, config, capture=capture_filter(flops=flops))

        return SizedStep(run, torch.randn(1024, 128))

    torch.manual_seed(0)
    eager = nn.Sequential(*[layer() for _ in range(3)])
    compiled = torch.compile(copy.deepcopy(eager))
    step = sized(compiled)
    peak = step.estimate_at().peak_bytes
    announced: list[float] = []
    searched = BatchSizeResult(0, None, peak - 1, (), 0.0)  # (the batch-size search is not this test's)
    options = advise(
        step, peak - 1, largest=searched, on_budget_value=announced.append, budget_values=(0.6, 0.3, 0.1)
    )
    offered = [o for o in options if o.kind == "compiled budget"]
    assert len(offered) == 1, options
    option = offered[0]
    assert option.activation_memory_budget == announced[-1] and option.peak_bytes < peak, (option, announced)
    assert announced == sorted(announced, reverse=True) and set(announced) <= {0.6, 0.3, 0.1}
    assert "activation_memory_budget = " in option.change and "FLOPs" in option.cost
    assert torch._functorch.config.activation_memory_budget == 1.0  # the user's setting, as it was
    announced.clear()
    eager_step = sized(eager)
    eager_peak = eager_step.estimate_at().peak_bytes
    searched = BatchSizeResult(0, None, eager_peak - 1, (), 0.0)
    eager_options = advise(eager_step, eager_peak - 1, largest=searched, on_budget_value=announced.append)
    assert announced == [] and all(o.kind != "compiled budget" for o in eager_options)
