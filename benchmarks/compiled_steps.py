"""Compiled steps on the CPU: the estimate against the measured compiled peak, and what it costs
(docs/compiled.md's tables).

Each model from its config (no weights downloaded), AdamW, 32-true, ``torch.compile(model)`` (inductor,
default mode), at the partitioner's default and under ``activation_memory_budget`` 0.5; each case in a
fresh process with a cache directory of its own, so every compile starts cold:

    python benchmarks/compiled_steps.py [--models gpt2,resnet34,vit_s] [--budgets 1.0,0.5] [--fits]
        [--advice 0.8] [--json]

Per step case: the estimate (``estimate_step`` of the compiled model), then two real compiled steps
measured by the CPU profiler's allocator events (``measure_step``; the estimate compiled first, so the
measurement's compile finds its graphs in the caches the estimate filled), and the eager step measured
for reference. With ``--fits``, per model a Lightning fit of three steps of the compiled model without
and with ``MemEstimate``, each in a fresh process from a cold cache: the cost of the callback on a
compiled fit, its own check after the first steps, and whether the weights and dynamo's frame counts
are the same. Inductor's CPU code for an embedding's backward adds into the gradient atomically from
every thread, so GPT-2's weights may differ in the last bits between any two fits, with or without the
callback; ``--deterministic`` (``Trainer(deterministic=True)``, where inductor generates no atomic
adds) compares them bit for bit. With ``--advice F``, per model the advice for a memory budget of F
times the compiled step's estimated peak (``plan_compiled_budget``: the highest
``activation_memory_budget`` that fits, each value tried re-simulated), and every value tried measured
(a fresh compile of the model under it): the value offered fits as measured, and each value above it
was over the budget as measured too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

MODELS = ("gpt2", "resnet34", "vit_s")


def fresh_process_rows(script: str, flag: str, cases: list[str]) -> list[dict[str, Any]]:
    """Each case run by ``script flag case`` in a fresh process (dynamo's and inductor's caches, the
    allocator, start empty for each), its row the JSON of its last line of output."""
    rows = []
    for case in cases:
        proc = subprocess.run(
            [sys.executable, script, flag, case], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise SystemExit(f"{case} failed:\n{proc.stderr[-4000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"done: {case}", file=sys.stderr)
    return rows


def _case(name: str) -> tuple[Any, Any, Any]:
    """The model, its batch and its loss, seeded."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if name == "gpt2":
        import transformers

        config = transformers.GPT2Config(n_layer=8, n_embd=256, n_head=8, n_positions=256, vocab_size=8192)
        model: torch.nn.Module = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 8192, (8, 256), generator=torch.Generator().manual_seed(1))

        def lm_loss(m: Any, b: Any) -> Any:
            return m(input_ids=b, labels=b).loss

        return model, ids, lm_loss
    if name == "resnet34":
        import torchvision

        model = torchvision.models.resnet34(weights=None)
        batch = torch.randn(16, 3, 128, 128, generator=torch.Generator().manual_seed(1))
    elif name == "vit_s":
        import timm

        model = timm.create_model("vit_small_patch16_224", pretrained=False)
        batch = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    else:
        raise SystemExit(f"unknown model {name!r}; one of {', '.join(MODELS)}")

    def loss(m: Any, b: Any) -> Any:
        out = m(b)
        return F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))

    return model, batch, loss


def run_case(name: str, budget: float) -> dict[str, Any]:
    """One accuracy case, in this process (a fresh one: see ``main``)."""
    import copy
    import tempfile

    import torch
    import torch._functorch.config
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from lightning_memest import estimate_step
    from lightning_memest.engine.step import StepConfig
    from lightning_memest.measure import measure_step

    model, batch, loss = _case(name)
    config = StepConfig(loss_fn=loss, optimizer=torch.optim.AdamW)
    eager = measure_step(copy.deepcopy(model), batch, config)
    torch._functorch.config.activation_memory_budget = budget
    with temporary_cache_dir(tempfile.mkdtemp()):
        compiled: Any = torch.compile(model)
        est = estimate_step(compiled, batch, loss_fn=loss, optimizer=torch.optim.AdamW)
        measured = measure_step(compiled, batch, config)  # its steps 1 and 2, compiled as a run's
    return {
        "model": name,
        "budget": budget,
        "estimated": {"first_step": est.first_step.bytes, "steady_state": est.steady_state.bytes},
        "measured": {"first_step": measured.first_step, "steady_state": measured.steady_state},
        "eager_measured": {"first_step": eager.first_step, "steady_state": eager.steady_state},
        "estimate_seconds": est.estimate_seconds,
        "compile_seconds": est.compile_seconds,
        "compiled_eagerly": est.compiled_eagerly,
        "graphs": len(set(est.compiled_graphs)),
    }


def run_fit(name: str, callback: bool, deterministic: bool = False) -> dict[str, Any]:
    """A Lightning fit of three steps of the compiled model (``self.model = torch.compile(model)``),
    with or without ``MemEstimate``, in this process, from a cold cache: its time, dynamo's frame
    counts, a hash of the trained weights and, with the callback, its own check."""
    import hashlib
    import tempfile
    import time

    import lightning.pytorch as pl
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memest import MemEstimate

    model, batch, loss = _case(name)

    class Compiled(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.compile(model)

        def training_step(self, b: Any, batch_idx: int) -> Any:
            return loss(self.model, b[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    module = Compiled()
    data = DataLoader(TensorDataset(torch.cat([batch] * 3)), batch_size=batch.shape[0])
    memest = MemEstimate(max_depth=0)
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        deterministic=deterministic,
        callbacks=[memest] if callback else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with temporary_cache_dir(tempfile.mkdtemp()):
        start = time.perf_counter()
        trainer.fit(module, data)
        seconds = time.perf_counter() - start
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    row: dict[str, Any] = {
        "model": name,
        "callback": callback,
        "fit_seconds": seconds,
        "frames": dict(counters["frames"]),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "weights": digest.hexdigest(),
    }
    est = memest.estimate
    if callback and est is not None:
        row.update(
            estimate_seconds=est.estimate_seconds,
            compile_seconds=est.compile_seconds,
            compiled_eagerly=est.compiled_eagerly,
            check_pct=[m.error_pct for m in memest.measured],
        )
    return row


def run_advice(name: str, fraction: float) -> dict[str, Any]:
    """The advice for a budget of ``fraction`` of the compiled step's estimated peak, and every value it
    tried measured, in this process (a fresh one, its own cache directory)."""
    import copy
    import tempfile
    import time

    import torch
    import torch._functorch.config
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from lightning_memest import plan_compiled_budget
    from lightning_memest.engine.step import StepConfig
    from lightning_memest.measure import measure_step

    model, batch, loss = _case(name)
    config = StepConfig(loss_fn=loss, optimizer=torch.optim.AdamW)
    with temporary_cache_dir(tempfile.mkdtemp()):
        compiled: Any = torch.compile(copy.deepcopy(model))
        args = {"loss_fn": loss, "optimizer": torch.optim.AdamW}
        baseline = plan_compiled_budget(compiled, batch, 2**50, **args).baseline
        budget = int(fraction * baseline.peak_bytes)
        start = time.perf_counter()
        found = plan_compiled_budget(compiled, batch, budget, **args)
        seconds = time.perf_counter() - start
        measured = {}
        for trial in found.trials:
            torch._dynamo.reset()
            with torch._functorch.config.patch(activation_memory_budget=trial.value):
                m = measure_step(torch.compile(copy.deepcopy(model)), batch, config)
            measured[str(trial.value)] = max(m.first_step, m.steady_state)
    return {
        "model": name,
        "fraction": fraction,
        "budget_bytes": budget,
        "baseline_peak_bytes": baseline.peak_bytes,
        "value": found.value,
        "seconds": seconds,
        "trials": [
            {"value": t.value, "estimated": t.peak_bytes, "measured": measured[str(t.value)]}
            for t in found.trials
        ],
    }


def _pct(a: int, b: int) -> str:
    return f"{100.0 * (a - b) / b:+.2f} %"


def _error(a: int, b: int) -> str:
    return f"{_pct(a, b)} ({a - b:+,} B)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: gpt2, resnet34, vit_s")
    parser.add_argument(
        "--budgets",
        default="1.0,0.5",
        help="activation_memory_budget values (1.0: default; '': no step cases)",
    )
    parser.add_argument(
        "--fits", action="store_true", help="also a Lightning fit per model, with and without"
    )
    parser.add_argument(
        "--deterministic", action="store_true", help="the fits under Trainer(deterministic=True)"
    )
    parser.add_argument(
        "--advice",
        type=float,
        default=None,
        metavar="F",
        help="also the compiler's-budget advice per model, for a budget of F times its compiled peak",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # step,name,budget | fit,name,0/1 | advice,name,F
    args = parser.parse_args()
    if args.case:
        kind, name, value, *det = args.case.split(",")
        if kind == "advice":
            row = run_advice(name, float(value))
        else:
            row = run_case(name, float(value)) if kind == "step" else run_fit(name, value == "1", bool(det))
        print(json.dumps(row))
        return
    names = args.models.split(",")
    cases = [f"step,{n},{b}" for n in names for b in args.budgets.split(",") if b]
    det = ",det" if args.deterministic else ""
    cases += [f"fit,{n},{c}{det}" for n in names for c in ("0", "1")] if args.fits else []
    cases += [f"advice,{n},{args.advice}" for n in names] if args.advice is not None else []
    rows = fresh_process_rows(__file__, "--case", cases)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        "| model | budget | measured compiled (step 1 / steady) | estimate error (step 1 / steady) "
        "| eager measured | graphs |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "budget" not in r:
            continue
        e, m, g = r["estimated"], r["measured"], r["eager_measured"]
        print(
            f"| {r['model']} | {r['budget']:g} | {_mib(m['first_step'])} / {_mib(m['steady_state'])} | "
            f"{_error(e['first_step'], m['first_step'])} / {_error(e['steady_state'], m['steady_state'])} | "
            f"{_mib(g['steady_state'])} (compiled {_pct(m['steady_state'], g['steady_state'])}) | "
            f"{r['graphs']} |"
        )
    advice = [r for r in rows if "fraction" in r]
    if advice:
        print()
        print("| model | budget | value offered | each value tried: estimated / measured | advice s |")
        print("|---|---|---|---|---|")
    for r in advice:
        tried = "; ".join(
            f"{t['value']:g}: {_mib(t['estimated'])} / {_mib(t['measured'])}" for t in r["trials"]
        )
        budget = f"{_mib(r['budget_bytes'])} ({r['fraction']:g} of {_mib(r['baseline_peak_bytes'])})"
        offered = "none" if r["value"] is None else f"{r['value']:g}"
        print(f"| {r['model']} | {budget} | {offered} | {tried} | {r['seconds']:.0f} |")
    fits = {(r["model"], r["callback"]): r for r in rows if "callback" in r}
    if not fits:
        return
    print()
    print(
        "| model | fit s, no callback | fit s, with it (estimate s, of which compile s) | "
        "callback's check | weights | dynamo's frames, graphs |"
    )
    print("|---|---|---|---|---|---|")
    for name in names:
        plain, watched = fits[(name, False)], fits[(name, True)]
        check = ", ".join(f"{p:+.2f} %" for p in watched.get("check_pct", [])) or "none"
        print(
            f"| {name} | {plain['fit_seconds']:.0f} | {watched['fit_seconds']:.0f} "
            f"({watched.get('estimate_seconds', 0.0):.0f}, {watched.get('compile_seconds', 0.0):.0f}) | "
            f"{check} | {'bit for bit equal' if plain['weights'] == watched['weights'] else 'DIFFER'} | "
            f"{plain['frames']['total']}, {plain['unique_graphs']} / "
            f"{watched['frames']['total']}, {watched['unique_graphs']} |"
        )


if __name__ == "__main__":
    main()
