"""Sizes, device budgets and the pre-check (budget.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memest import estimate_step
from lightning_memest.budget import device_budget, parse_size, precheck
from lightning_memest.errors import MemoryBudgetError


def test_parse_size() -> None:
    assert parse_size("10GiB") == 10 * 2**30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512 mib") == 512 * 2**20
    assert parse_size("123") == 123
    for bad in ("", "GiB", "-1GiB", "1.5XB", "0", "nan"):
        with pytest.raises(ValueError):
            parse_size(bad)


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
    err = bad.error()
    assert isinstance(err, MemoryBudgetError) and str(err) == bad.message
    assert (err.peak_bytes, err.batch_size, err.max_batch_size) == (est.peak_bytes, 64, 17)


def test_device_budget_margins() -> None:
    assert device_budget("cpu") > 0
    assert device_budget("cpu", margin_bytes=2**62) == 0
    # What the estimate counts that already exists is given back.
    assert device_budget("cpu", resident_bytes=2**30) >= 2**30
