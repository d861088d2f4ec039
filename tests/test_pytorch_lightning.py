"""``MemEstimate`` under the standalone ``pytorch_lightning`` package (issue 46, item 4).

Libraries build on either Lightning package (neuralforecast on ``pytorch_lightning``): the callback is
one implementation for both (``adapter/package.py``). A fit with ``pytorch_lightning``'s Trainer and a
``pytorch_lightning.LightningModule``, as such a library's user runs it, in a fresh process (the
summary is read from its output): the estimate is made and checks itself within 1 %, the model
summary is printed once (the estimate's, in place of Lightning's), no warning of the callback's, and
the weights are bit for bit those of the same fit without the callback, and the package's own
``TensorBoardLogger`` gets the estimate's series.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_memest import MemEstimate

    class Forecaster(pl.LightningModule):  # (an MLP forecaster, as neuralforecast's are built)
        def __init__(self):
            super().__init__()
            layers = [torch.nn.Linear(48, 128), torch.nn.ReLU(), torch.nn.Linear(128, 12)]
            self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    def fit(callback):
        pl.seed_everything(0, verbose=False)
        g = torch.Generator().manual_seed(1)
        data = DataLoader(TensorDataset(torch.randn(64, 48, generator=g), torch.randn(64, 12, generator=g)),
                          batch_size=16)
        module = Forecaster()
        memest = MemEstimate(max_depth=1)
        logger = TensorBoardLogger(sys.argv[1], name=str(callback))  # pytorch_lightning's own logger
        trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=logger, enable_checkpointing=False,
                             enable_progress_bar=False, callbacks=[memest] if callback else [])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, data)
        mine = [str(w.message) for w in caught if "MemEstimate" in str(w.message)]
        weights = [p.detach().clone() for p in module.parameters()]
        return memest, weights, mine, logger.log_dir

    plain, plain_weights, _, _ = fit(False)
    print("=== with the callback")
    memest, weights, mine, log_dir = fit(True)
    runs = os.path.join(log_dir, "memest")
    print("RESULT " + json.dumps({
        "estimated": memest.estimate is not None,
        "errors": [m.error_pct for m in memest.measured],
        "warnings": mine,
        "same_weights": all(torch.equal(a, b) for a, b in zip(plain_weights, weights)),
        "runs": sorted(os.listdir(runs)) if os.path.isdir(runs) else [],
    }))
    """
)


def test_a_fit_on_pytorch_lightning_is_estimated_checked_and_summarised_once(tmp_path: Path) -> None:
    script = [sys.executable, "-c", _SCRIPT, str(tmp_path)]
    done = subprocess.run(script, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert out["estimated"] and out["warnings"] == [], out
    assert out["errors"] and all(abs(e) <= 1.0 for e in out["errors"]), out
    assert out["same_weights"], out
    assert out["runs"] == ["measured", "simulated"], out  # its TensorBoardLogger got the estimate's series
    with_callback = done.stdout.split("=== with the callback", 1)[1]
    headers = [x for x in with_callback.splitlines() if "Name" in x and "Type" in x and "Params" in x]
    assert len(headers) == 1, with_callback  # one table: Lightning's own summary gave way
    assert "Estimated peak memory, first step" in with_callback
