"""What the ranks of a distributed fit agree on before the callback acts on its own rank's result.

Under DDP a rank that takes a branch the others do not -- it measured, so it reduces its peak; its
estimate failed, so it skips the pre-check's vote -- waits forever in a collective the others never
enter. So every decision that depends on one rank's estimate or measurement is made from what all
ranks found: :func:`first_failure` tells every rank whether any failed, and how (the same words on
every rank, for one warning alike everywhere); :func:`max_over_ranks` gives every rank the largest
measured peak. In a single process both answer at once, with no collective.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

__all__ = ["first_failure", "max_over_ranks"]


def first_failure(trainer: pl.Trainer, failure: str | None) -> str | None:
    """The failure of the lowest rank that failed (``failure``: this rank's, ``None`` if it did not),
    the same on every rank, or ``None`` where no rank failed. A collective: every rank calls it at
    the same point."""
    if trainer.world_size == 1:
        return failure
    strategy = trainer.strategy
    world = trainer.world_size
    mine = trainer.global_rank if failure is not None else world
    # One small gather on the path where every rank succeeded (all_gather: every strategy has it, not
    # every one reduces with "min"); the words travel only on a failure.
    rank = int(strategy.all_gather(torch.tensor(mine, device=strategy.root_device)).min().item())
    if rank >= world:
        return None
    words = strategy.broadcast(failure, src=rank)
    return f"{words} (on rank {rank})"


def max_over_ranks(trainer: pl.Trainer, result: tuple[int, int | None]) -> tuple[int, int | None]:
    """Under DDP every rank measures its own step; the peak that matters is the largest. A collective."""
    if trainer.world_size == 1:
        return result
    peak, reserved = result
    values = torch.tensor([peak, reserved or 0], dtype=torch.int64, device=trainer.strategy.root_device)
    largest = trainer.strategy.all_gather(values).reshape(-1, 2).max(dim=0).values
    return int(largest[0].item()), None if reserved is None else int(largest[1].item())
