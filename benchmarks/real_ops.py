"""What the ops run for real cost an estimate (issue 25): their share of the estimate's time.

Run: ``python benchmarks/real_ops.py [--json]``. Two steps whose fake kernels fail somewhere, each
estimated twice in a fresh process (the first estimate runs each op signature for real once; a later
one of the same shapes reuses what it found): transformers' Mixtral MoE training step
(``aten._grouped_mm``) and an ``nn.TransformerEncoder`` validation batch with a padding mask (its
nested-tensor fast path). The time inside ``engine.real_ops.run_for_real`` against the whole estimate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lightning_memest.engine.tracker as tracker
from lightning_memest import estimate_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the zoo's cases

_SPENT = [0.0]
_RUN = tracker.run_for_real


def _timed(*args: Any, **kwargs: Any) -> Any:
    began = time.perf_counter()
    try:
        return _RUN(*args, **kwargs)
    finally:
        _SPENT[0] += time.perf_counter() - began


def mixtral() -> Callable[[], Any]:
    from transformers import MixtralForCausalLM
    from zoo_families import mixtral_config

    model, ids = MixtralForCausalLM(mixtral_config()), torch.randint(0, 512, (4, 32))

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]

    return lambda: estimate_step(model, ids, loss_fn=loss, optimizer=torch.optim.AdamW)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.enc(x, src_key_padding_mask=pad)


def padded_encoder() -> Callable[[], Any]:
    model = _Encoder()
    x = torch.randn(16, 24, 64)
    pad = torch.arange(24)[None] >= torch.randint(6, 25, (16,))[:, None]
    return lambda: estimate_step(model, (x, pad), loop="validate")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON value instead of a table")
    args = parser.parse_args()
    tracker.run_for_real = _timed  # type: ignore[assignment]
    rows = []
    for name, make in (("Mixtral MoE training step", mixtral), ("padded encoder validation", padded_encoder)):
        run = make()
        for attempt in ("first", "again"):
            _SPENT[0] = 0.0
            began = time.perf_counter()
            estimate = run()
            total = time.perf_counter() - began
            ops = sum((estimate.real_ops or {}).values())
            rows.append(
                {
                    "case": name,
                    "estimate": attempt,
                    "seconds": total,
                    "real_ops_seconds": _SPENT[0],
                    "calls": ops,
                }
            )
    if args.json:
        print(json.dumps(rows))
        return
    print("| case | estimate | s | ops run for real | their s | share |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        share = 100 * r["real_ops_seconds"] / r["seconds"]
        print(
            f"| {r['case']} | {r['estimate']} | {r['seconds']:.3f} | {r['calls']} | "
            f"{r['real_ops_seconds']:.3f} | {share:.1f} % |"
        )


if __name__ == "__main__":
    main()
