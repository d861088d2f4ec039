"""Sizes, device budgets and the pre-check (budget.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memest import estimate_step
from lightning_memest.budget import budget_for, device_budget, parse_size, precheck
from lightning_memest.errors import MemoryBudgetError
from lightning_memest.sizes import MAX_SIZE, MemoryBudget


def test_parse_size() -> None:
    assert parse_size("10GiB") == 10 * 2**30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512 mib") == 512 * 2**20
    assert parse_size("123") == 123
    for bad in ("", "GiB", "-1GiB", "1.5XB", "0", "nan"):
        with pytest.raises(ValueError):
            parse_size(bad)
    # Too large is said so (it read "must be at least one byte"), and the answer stays a number.
    for huge in ("1e300TiB", "1e400", "1e19"):
        with pytest.raises(ValueError, match="at most 8 EiB"):
            parse_size(huge)
    assert parse_size(str(MAX_SIZE)) <= MAX_SIZE


def test_memory_budgets_are_bytes_sizes_or_shares() -> None:
    assert MemoryBudget.parse(4096) == MemoryBudget(bytes=4096)
    assert MemoryBudget.parse("1KiB") == MemoryBudget(bytes=1024)
    assert MemoryBudget.parse(" 80 % ") == MemoryBudget(share=0.8)
    for bad in (-1, 0, -5, "0%", "150%", "-3%", "1KiB%", 2**64):
        with pytest.raises(ValueError):
            MemoryBudget.parse(bad)  # type: ignore[arg-type]
    for wrong in (True, 1.5, [1]):
        with pytest.raises(TypeError):
            MemoryBudget.parse(wrong)  # type: ignore[arg-type]
    est = estimate_step(nn.Linear(10, 10), torch.randn(4, 10))
    device = budget_for(est, "cpu")
    half = budget_for(est, "cpu", memory_budget="50%")
    assert abs(half - device // 2) <= device // 100  # (the machine's free memory moves a little)


def test_precheck_messages() -> None:
    est = estimate_step(nn.Linear(100, 100), torch.randn(64, 100), optimizer=torch.optim.Adam)
    ok = precheck(est, est.peak_bytes, batch_size=64)
    assert ok.fits and "within" in ok.message
    calls: list[int] = []

    def best() -> int:
        calls.append(1)
        return 17

    bad = precheck(est, est.peak_bytes - 1, batch_size=64, max_fit=best)
    assert not bad.fits and bad.max_batch_size == 17 and calls == [1]
    for part in (f"{est.peak_bytes:,} B", f"{est.peak_bytes - 1:,} B", "batch size 64", "fits is 17"):
        assert part in bad.message
    # What the peak holds, and how much of it no batch size changes: the next step to take.
    assert "at the peak (step " in bad.message and "optimizer state" in bad.message
    assert "model's state and other tensors, whatever the batch size" in bad.message
    err = bad.error()
    assert isinstance(err, MemoryBudgetError) and str(err) == bad.message
    assert (err.peak_bytes, err.batch_size, err.max_batch_size) == (est.peak_bytes, 64, 17)


def test_device_budget_margins() -> None:
    assert device_budget("cpu") > 0
    assert device_budget("cpu", margin_bytes=2**62) == 0
    # What the estimate counts that already exists is given back.
    assert device_budget("cpu", resident_bytes=2**30) >= 2**30
