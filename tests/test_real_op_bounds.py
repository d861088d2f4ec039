"""Real ops are bounded on what they make (issue 44, item 4): an op with no fake kernel whose kernel is
Python runs that kernel on fake tensors (nothing allocated for real, its data-dependent ops bounded and
listed); an op run for real whose outputs' sizes follow values is refused, or listed where that cannot be
checked. Checked against the CPU allocator's events (``measure_step``) and the process's resident peak."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_memest import EstimationError, estimate_step
from lightning_memest.engine.real_ops import REAL_OP_LIMIT
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step


@torch.library.custom_op("memest_test_bounds::tile16", mutates_args=())
def tile16(x: Tensor) -> Tensor:
    """A user's op without a fake kernel whose output is sixteen times its input."""
    return x.repeat(16, 1)


def _tile16_backward(ctx: Any, grad: Tensor) -> Tensor:
    return grad.view(16, grad.shape[0] // 16, *grad.shape[1:]).sum(0)


tile16.register_autograd(_tile16_backward)


@torch.library.custom_op("memest_test_bounds::positives", mutates_args=())
def positives(x: Tensor) -> Tensor:
    """A user's op without a fake kernel that keeps the positive elements: its size follows values."""
    return x[x > 0]


def _positives_context(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    ctx.save_for_backward(inputs[0] > 0)


def _positives_backward(ctx: Any, grad: Tensor) -> Tensor:
    (mask,) = ctx.saved_tensors
    out = grad.new_zeros(mask.shape)
    out[mask] = grad
    return out


positives.register_autograd(_positives_backward, setup_context=_positives_context)


@torch.library.custom_op("memest_test_bounds::numpy_positives", mutates_args=(), device_types="cpu")
def numpy_positives(x: Tensor) -> Tensor:
    """The positives through NumPy: a kernel that cannot run on fake tensors (it reads the data)."""
    a = x.numpy()
    return torch.from_numpy(a[a > 0].copy())


@torch.library.custom_op("memest_test_bounds::numpy_lookup", mutates_args=(), device_types="cpu")
def numpy_lookup(table: Tensor, ids: Tensor) -> Tensor:
    """Rows of a table picked through NumPy (an index out of range raises, as NumPy does)."""
    return torch.from_numpy(table.numpy()[ids.numpy()].copy())


class Tiled(nn.Module):
    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return tile16(self.layer(x))  # type: ignore[no-any-return]


class Positives(nn.Module):
    """A layer whose positive activations are summed apart, through the custom op."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 64)

    def select(self, h: Tensor) -> Tensor:
        return positives(h)  # type: ignore[no-any-return]

    def forward(self, x: Tensor) -> Tensor:
        h = self.layer(x)
        return self.select(h).sum() + h.sum()  # type: ignore[no-any-return]


class PlainPositives(Positives):
    """The same, written as plain code."""

    def select(self, h: Tensor) -> Tensor:
        return h[h > 0]


class NumpyPositives(Positives):
    """The same through NumPy, summed apart from the gradient's path (a statistic)."""

    def select(self, h: Tensor) -> Tensor:
        return numpy_positives(h.detach())  # type: ignore[no-any-return]


def _squares(model: nn.Module, batch: Tensor) -> Tensor:
    return model(batch).pow(2).mean()  # type: ignore[no-any-return]


def _sum(model: nn.Module, batch: Tensor) -> Tensor:
    return model(batch)  # type: ignore[no-any-return]


def _peak_resident() -> int:
    """The process's resident high-water mark (VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def _reset_peak_resident() -> bool:
    """Reset VmHWM to the current resident size (Linux 4.0+); ``False`` where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def test_a_big_output_is_simulated_not_allocated() -> None:
    # A meta batch of 48 MiB: the op's 768 MiB output would be allocated for real if it ran on stand-ins.
    batch = torch.empty(12288, 1024, device="meta")
    model = Tiled()
    estimate_step(model, batch[:128], loss_fn=_squares)  # a first estimate's imports and caches
    if not _reset_peak_resident():
        pytest.skip("no /proc/self/clear_refs to reset the resident peak")
    before = _peak_resident()
    est = estimate_step(model, batch, loss_fn=_squares)
    grown = _peak_resident() - before
    assert grown < REAL_OP_LIMIT, f"the process grew {grown / 2**20:.0f} MiB"
    assert est.real_ops is None  # not run for real: its Python kernel ran on fake tensors
    output = 16 * batch.numel() * batch.element_size()
    assert min(p.bytes for p in est.peaks) > output


def test_a_big_output_is_estimated_as_it_runs() -> None:
    torch.manual_seed(0)
    model, batch = Tiled(256), torch.randn(512, 256)
    est = estimate_step(copy.deepcopy(model), batch, loss_fn=_squares, optimizer=torch.optim.Adam)
    config = StepConfig(loss_fn=_squares, optimizer=torch.optim.Adam)
    measured = measure_step(copy.deepcopy(model), batch, config)
    for peak, real in zip(est.peaks, measured.peak_bytes, strict=True):
        assert abs(peak.bytes - real) <= 0.01 * real, (peak.bytes, real)


@pytest.mark.parametrize("kind", [Positives, PlainPositives], ids=["custom op", "plain code"])
def test_a_selection_of_positives_is_bounded_and_listed(kind: type[Positives]) -> None:
    torch.manual_seed(0)
    model = kind()
    batch = torch.randn(4096, 64)
    est = estimate_step(copy.deepcopy(model), batch, loss_fn=_sum)
    measured = measure_step(copy.deepcopy(model), batch, StepConfig(loss_fn=_sum))
    for peak, real in zip(est.peaks, measured.peak_bytes, strict=True):
        assert peak.bytes >= real, (peak.bytes, real)  # an upper bound: every element selected
    (read,) = est.data_dependent or ()
    assert read.op == "aten.index.Tensor" and read.bound and not read.exact
    assert read.assumed.startswith(f"every element of the mask set ({batch.numel()})")
    if kind is Positives:
        assert read.assumed.endswith("inside memest_test_bounds.positives.default")
    assert est.lowering_reads == () and "could have lowered" not in str(est)


def test_an_op_run_for_real_whose_size_follows_values_is_refused() -> None:
    with pytest.raises(EstimationError, match=r"sizes follow its inputs' values .*register_fake") as info:
        estimate_step(NumpyPositives(), torch.randn(256, 64), loss_fn=_sum, steps=1)
    assert info.value.op == "memest_test_bounds.numpy_positives.default"


def test_an_op_run_for_real_that_cannot_be_checked_is_listed() -> None:
    # Ids computed from activations are unknown; ones in them are out of range for a one-row table:
    # whether the size follows the values cannot be checked, and the estimate says so instead of
    # taking zeros' answer silently.
    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)
            self.table = nn.Parameter(torch.randn(1, 8))

        def forward(self, x: Tensor) -> Tensor:
            h = self.layer(x)
            ids = (h.sum(-1) > 1e9).long()  # all 0 in the real run
            with torch.no_grad():
                rows = numpy_lookup(self.table.detach(), ids)
            return rows.sum() + h.sum() + self.table.sum()  # type: ignore[no-any-return]

    est = estimate_step(Lookup(), torch.randn(32, 8), loss_fn=_sum, steps=1)
    assert est.real_ops == {"memest_test_bounds.numpy_lookup.default": 1}
    (read,) = est.lowering_reads
    assert read.op == "memest_test_bounds.numpy_lookup.default" and "IndexError" in read.assumed
    assert "could have lowered the estimate" in str(est)


def test_a_python_kernel_registered_with_library_impl_runs_on_fake_tensors() -> None:
    library = torch.library.Library("memest_test_bounds_lib", "DEF")  # type: ignore[no-untyped-call]
    try:
        library.define("tile4(Tensor x) -> Tensor")  # type: ignore[no-untyped-call]
        library.impl("tile4", lambda x: x.repeat(4, 1), "CPU")  # type: ignore[no-untyped-call]
        op = torch.ops.memest_test_bounds_lib.tile4.default

        class Tiled4(nn.Module):
            def forward(self, x: Tensor) -> Tensor:
                with torch.no_grad():
                    return op(x).sum() + x.sum()  # type: ignore[no-any-return]

        batch = torch.randn(512, 256)
        est = estimate_step(Tiled4(), batch, loss_fn=_sum, steps=1)
        measured = measure_step(Tiled4(), batch, StepConfig(loss_fn=_sum), steps=1)
        assert est.real_ops is None
        assert abs(est.peaks[0].bytes - measured.peak_bytes[0]) <= 0.01 * measured.peak_bytes[0]
    finally:
        library._destroy()  # type: ignore[no-untyped-call]
