"""Find the memory that real CPU or CUDA kernels allocate beyond what their fake (meta) kernels report.

Runs real training steps under the CPU profiler (``profile_memory=True``) with a recording
``TorchDispatchMode`` that wraps each dispatched aten op -- the same ops, in the same order, that a
fake-tensor run sees -- in ``record_function("memest_op_<k>")``. Each ``[memory]`` event (from
``experimental_event_tree()``, which carries the pointer of every allocation) is assigned to the op
whose window holds it, and per op call the script reports:

* ``transient``: the most bytes held at once by allocations made *and* freed inside the op (kernel
  workspaces), whether the op's surviving allocations were already made at that moment
  (``after_out``), and the innermost ``aten::`` op that made the largest of them;
* ``out_real``: bytes allocated inside the op that survive its end (its outputs, or state it keeps);
* ``out_fake``: the bytes of the new output storages the same op returns on fake tensors of the same
  shapes, strides and dtypes (the op is replayed under ``FakeTensorMode`` after the profile).

Which op holds each step's peak is printed too. ``--json PATH`` writes every op call (arguments as
metadata) for offline analysis.

``--device cuda`` (on a machine with a GPU) does the same for CUDA kernels: the profiler records the
caching allocator's block allocations (512 B-rounded, as ``max_memory_allocated`` counts them), so
cuDNN/cuBLAS workspaces, the cuBLAS handle workspace (an allocation that survives its op), cuDNN
batch-norm and RNN reserve spaces (real outputs bigger than the fake ones: ``extra``) all show up per
op. Each step's peak as rebuilt from the events is printed next to ``torch.cuda.max_memory_allocated``
(an independent check of the reconstruction), and the JSON's ``meta`` carries the GPU, its capability
and the cuDNN version.

Usage::

    python benchmarks/find_kernel_workspaces.py resnet18 --batch-size 8 --optimizer adam --precision 32-true
    python benchmarks/find_kernel_workspaces.py lstm --batch-size 16 --optimizer sgd --all
    python benchmarks/find_kernel_workspaces.py resnet50 --device cuda --json resnet50_cuda.json

Model names: any torchvision classification model (built with ``weights=None``, input 3x224x224,
cross-entropy against random targets), ``gpt`` (tests/models.py TinyGPT) or ``lstm``
(tests/models.py LSTMLanguageModel), both on sequences of 128 tokens, or any ``package.module:name``
as ``memest`` takes it, with ``--input-shape`` (cross-entropy over the output's last dimension)::

    python benchmarks/find_kernel_workspaces.py mymodels:Conv3dNet --input-shape 3,8,32,32 --batch-size 4
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_memest.engine.events import Phase
from lightning_memest.engine.step import StepConfig, StepRunner
from tests.models import (
    LSTMLanguageModel,
    TinyGPT,
    classification_loss,
    lm_batch,
    lm_loss,
)

OP_LABEL = "memest_op_"
STEP_LABEL = "memest_step_"
# Factory ops that only allocate: the allocation is attributed to the op that called them.
_ALLOCATING = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_", "aten::new_empty"}


@dataclass(frozen=True)
class Spec:
    """A tensor argument or output, as metadata."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: str
    nbytes: int  # of its storage

    @staticmethod
    def of(t: Tensor) -> Spec:
        return Spec(
            tuple(t.shape),
            tuple(t.stride()),
            t.storage_offset(),
            t.dtype,
            t.device.type,
            t.untyped_storage().nbytes(),
        )

    def json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "stride": list(self.stride),
            "dtype": str(self.dtype).removeprefix("torch."),
            "nbytes": self.nbytes,
        }


@dataclass
class Call:
    k: int
    step: int
    phase: str
    op: torch._ops.OpOverload
    args: Any  # pytree of Spec / python values
    kwargs: Any
    outputs: list[Spec | None]
    new_out_real: int  # bytes of output storages not among the inputs'
    # filled in from the profile
    start: int = 0
    end: int = 0
    transient: int = 0
    after_out: bool = True
    inner: str = ""
    out_real: int = 0
    freed_old: int = 0
    events: list[tuple[int, int, str]] = field(default_factory=list)  # (bytes, ptr, inner op)
    held_before: int = 0
    held_max: int = 0
    excess: int = 0  # most bytes held inside the op beyond (held before it + its surviving allocations)
    out_fake: int | None = None
    fake_error: str = ""
    extra: list[int] = field(default_factory=list)


class Recorder(TorchDispatchMode):
    """Records each dispatched op and wraps it in a profiler label."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.step = 0
        self.phase = Phase.SETUP.value

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        k = len(self.calls)
        inputs = {
            t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)
        }
        with record_function(f"{OP_LABEL}{k}"):
            out = func(*args, **kwargs)
        leaves = tree_flatten(out)[0]
        new: dict[int, int] = {}
        for t in leaves:
            if isinstance(t, Tensor) and t.untyped_storage()._cdata not in inputs:
                new[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        spec = lambda x: Spec.of(x) if isinstance(x, Tensor) else x  # noqa: E731
        self.calls.append(
            Call(
                k,
                self.step,
                self.phase,
                func,
                tree_map(spec, args),
                tree_map(spec, kwargs),
                [Spec.of(t) if isinstance(t, Tensor) else None for t in leaves],
                sum(new.values()),
            )
        )
        return out


class PhaseListener:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_phase(self, phase: Phase, step: int) -> None:
        self.recorder.phase = phase.value
        self.recorder.step = step

    def on_gradients(self, grads: list[Tensor]) -> None:
        pass

    def on_optimizer_state(self, state: list[Tensor]) -> None:
        pass


# --------------------------------------------------------------------------------------------- models


def build_case(
    name: str,
    batch_size: int,
    precision: str,
    optimizer: str,
    device: str = "cpu",
    input_shape: tuple[int, ...] | None = None,
) -> tuple[nn.Module, Any, StepConfig]:
    """Model, batch and step config of a named case (model trained in place by the caller)."""
    torch.manual_seed(0)
    loss_fn: Callable[[nn.Module, Any], Tensor]
    if ":" in name:
        from lightning_memest.cases import InputSpec
        from lightning_memest.cases import build_case as build_spec

        sys.path.insert(0, str(Path.cwd()))  # as memest does: the current directory is importable
        case = build_spec(
            name,
            InputSpec(batch_size=batch_size, shape=input_shape or (3, 224, 224)),
            optimizer=optimizer,
            precision=precision,
        )
        model, batch, loss_fn = case.model, case.batch, case.config.loss_fn
    elif name == "gpt":
        model: nn.Module = TinyGPT()
        batch: Any = lm_batch(batch_size)
        loss_fn = lm_loss
    elif name == "lstm":
        model = LSTMLanguageModel()
        batch = lm_batch(batch_size)
        loss_fn = lm_loss
    else:
        import torchvision

        model = torchvision.models.get_model(name, weights=None)
        g = torch.Generator().manual_seed(0)
        batch = (
            torch.randn(batch_size, 3, 224, 224, generator=g),
            torch.randint(0, 1000, (batch_size,), generator=g),
        )
        loss_fn = classification_loss
    model.train()
    if precision.endswith("-true") and precision != "32-true":
        dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}[precision]
        model = model.to(dtype)
        batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
    model = model.to(device)
    batch = tuple(t.to(device) for t in batch)
    factories: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "none": lambda ps: None,  # type: ignore[arg-type,return-value]
    }
    opt = factories[optimizer]
    config = StepConfig(loss_fn=loss_fn, optimizer=None if optimizer == "none" else opt, precision=precision)  # type: ignore[arg-type]
    return model, batch, config


def resident(model: nn.Module, batch: Any, device: str) -> int:
    """Bytes the allocator holds before the profiled steps (CUDA: its own count, blocks included)."""
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    from lightning_memest.batches import iter_tensors
    from lightning_memest.measure import resident_bytes

    return resident_bytes([*model.parameters(), *model.buffers(), *iter_tensors(batch)])


def _device_type(extra_fields: Any) -> str:
    device = extra_fields.device
    return device if isinstance(device, str) else str(device.type)


# ------------------------------------------------------------------------------------------- analysis


def _flatten(nodes: list[Any]) -> Iterator[Any]:
    stack = list(nodes)
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children)


def _inner_op(node: Any) -> str:
    p = node.parent
    while p is not None:
        if p.name.startswith("aten::") and p.name not in _ALLOCATING:
            return str(p.name)
        if p.name.startswith(OP_LABEL):
            break
        p = p.parent
    return "?"


def analyse(calls: list[Call], prof: profile, steps: int, device: str = "cpu") -> list[tuple[int, int, int]]:
    """Fill in each call's memory numbers, from the allocation events of ``device``'s allocator.

    Returns per step: (peak above the baseline, the op call holding it, bytes held before that op).
    """
    nodes = list(_flatten(prof.profiler.kineto_results.experimental_event_tree()))
    windows: dict[int, tuple[int, int]] = {}
    steps_w: dict[int, tuple[int, int]] = {}
    allocs = []
    for n in nodes:
        if n.name.startswith(OP_LABEL):
            windows[int(n.name[len(OP_LABEL) :])] = (n.start_time_ns, n.end_time_ns)
        elif n.name.startswith(STEP_LABEL):
            steps_w[int(n.name[len(STEP_LABEL) :])] = (n.start_time_ns, n.end_time_ns)
        elif n.name == "[memory]":
            ef = n.extra_fields
            if _device_type(ef) == device:
                allocs.append((n.start_time_ns, ef.alloc_size, ef.ptr, n))
    if not allocs:
        sys.exit(f"find_kernel_workspaces: the profile holds no {device} allocation events")
    allocs.sort(key=lambda a: a[0])
    for c in calls:
        c.start, c.end = windows[c.k]
    starts = [c.start for c in calls]
    per_call: dict[int, list[Any]] = defaultdict(list)
    held = 0
    step_peak = [(0, -1, 0)] * steps
    for t, size, ptr, node in allocs:
        i = bisect.bisect_right(starts, t) - 1
        k = i if i >= 0 and calls[i].start <= t <= calls[i].end else -1
        if k >= 0 and not per_call[k]:
            calls[k].held_before = calls[k].held_max = held
        held += size
        if k >= 0:
            per_call[k].append((t, size, ptr, node))
            calls[k].held_max = max(calls[k].held_max, held)
        for s, (a, b) in steps_w.items():
            if a <= t <= b and held > step_peak[s][0]:
                step_peak[s] = (held, k, calls[k].held_before if k >= 0 else held)
    for k, evs in per_call.items():
        c = calls[k]
        # An allocation is transient when a later free in this window has its pointer (pointers are reused).
        is_transient: list[bool] = [False] * len(evs)
        freed_later: set[int] = set()
        for j in range(len(evs) - 1, -1, -1):
            size, ptr = evs[j][1], evs[j][2]
            if size < 0:
                freed_later.add(ptr)
            else:
                is_transient[j] = ptr in freed_later
                freed_later.discard(ptr)
        live: dict[int, int] = {}
        trans_live = 0
        best = 0
        best_node = None
        surv_made = 0
        surv_total = 0
        surv_at_best = 0
        for j, (_t, size, ptr, node) in enumerate(evs):
            c.events.append((size, ptr, _inner_op(node)))
            if size > 0:
                transient = is_transient[j]
                live[ptr] = size if transient else -size
                if transient:
                    trans_live += size
                    if trans_live > best:
                        best, best_node, surv_at_best = trans_live, node, surv_made
                else:
                    surv_made += size
            else:
                if ptr in live and live[ptr] > 0:
                    trans_live -= live.pop(ptr)
                else:
                    c.freed_old += -size
        surv_total = surv_made
        c.transient = best
        c.after_out = surv_at_best >= surv_total
        c.inner = _inner_op(best_node) if best_node is not None else ""
        c.out_real = surv_total
        c.excess = max(0, c.held_max - c.held_before - surv_total)
    return step_peak


def _fake_args(tree: Any) -> Any:
    def build(x: Any) -> Any:
        if isinstance(x, Spec):
            itemsize = x.dtype.itemsize
            n = max(x.nbytes // itemsize, 1)
            return torch.empty(n, dtype=x.dtype, device=x.device).as_strided(x.shape, x.stride, x.offset)
        return x

    return tree_map(build, tree)


def replay_fake(calls: list[Call]) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache: dict[Any, tuple[int | None, str]] = {}
    for c in calls:
        key = repr((c.op, c.args, c.kwargs))
        if key not in cache:
            try:
                with FakeTensorMode(allow_non_fake_inputs=True):
                    args, kwargs = _fake_args(c.args), _fake_args(c.kwargs)
                    inputs = {
                        t.untyped_storage()._cdata
                        for t in tree_flatten((args, kwargs))[0]
                        if isinstance(t, Tensor)
                    }
                    out = c.op(*args, **kwargs)
                    new = {
                        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                        for t in tree_flatten(out)[0]
                        if isinstance(t, Tensor) and t.untyped_storage()._cdata not in inputs
                    }
                    fake_specs = [Spec.of(t) if isinstance(t, Tensor) else None for t in tree_flatten(out)[0]]
                cache[key] = (sum(new.values()), "")
                c.extra = [
                    r.nbytes - f.nbytes if r and f else 0 for r, f in zip(c.outputs, fake_specs, strict=False)
                ]
            except Exception as e:
                cache[key] = (None, f"{type(e).__name__}: {str(e)[:80]}")
        c.out_fake, c.fake_error = cache[key]


def _shapes(tree: Any) -> str:
    parts = []
    for x in tree_flatten(tree)[0]:
        if isinstance(x, Spec):
            parts.append(f"{list(x.shape)}{str(x.dtype).removeprefix('torch.')[:4]}")
    s = ",".join(parts)
    return s if len(s) < 90 else s[:87] + "..."


def run(
    name: str,
    batch_size: int,
    optimizer: str,
    precision: str,
    steps: int,
    device: str = "cpu",
    input_shape: tuple[int, ...] | None = None,
) -> tuple[list[Call], list[Any], int, list[int] | None]:
    """The op calls, each step's (peak, op, held before it), the resident bytes, and on CUDA each
    step's ``max_memory_allocated`` (the allocator's own count, to check the events against)."""
    model, batch, config = build_case(name, batch_size, precision, optimizer, device, input_shape)
    base = resident(model, batch, device)
    recorder = Recorder()
    runner = StepRunner(model, config, listener=PhaseListener(recorder))
    cuda_peaks: list[int] | None = [] if device == "cuda" else None
    # CUDA allocations are recorded with the CPU activity alone in recent torch; CUDA's activity is
    # added so that older profilers (which needed it) record them too.
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        for i in range(steps):
            if cuda_peaks is not None:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            with record_function(f"{STEP_LABEL}{i}"), recorder:
                loss = runner.run(batch)
            del loss
            if cuda_peaks is not None:
                torch.cuda.synchronize()
                cuda_peaks.append(torch.cuda.max_memory_allocated())
    peaks = analyse(recorder.calls, prof, steps, device)
    replay_fake(recorder.calls)
    return recorder.calls, peaks, base, cuda_peaks


def device_meta(device: str) -> dict[str, Any]:
    """What decides the kernels' choices: torch, and on CUDA the GPU, its capability and cuDNN."""
    meta: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        meta |= {
            "gpu": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "cudnn": torch.backends.cudnn.version(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cuda": torch.version.cuda,
        }
    else:
        meta["threads"] = torch.get_num_threads()
    return meta


def _jsonable(x: Any) -> Any:
    if isinstance(x, Spec):
        return x.json()
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (int, float, bool, str)) or x is None:
        return x
    return str(x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw", "none"])
    p.add_argument(
        "--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true", "16-true"]
    )
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=1024, help="hide op calls below this many bytes")
    p.add_argument("--all", action="store_true", help="list every op call, not a summary per op and shape")
    p.add_argument("--json", type=Path, help="write every op call here")
    p.add_argument(
        "--show", type=int, nargs="*", default=[], help="print the memory events of these op calls"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--input-shape", help="C,H,W... of a package.module:name model's float input (default 3,224,224)"
    )
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    shape = tuple(int(d) for d in a.input_shape.split(",")) if a.input_shape else None
    calls, peaks, base, cuda_peaks = run(
        a.model, a.batch_size, a.optimizer, a.precision, a.steps, a.device, shape
    )
    print(
        f"# {a.model} batch {a.batch_size} {a.optimizer} {a.precision} on {a.device}: "
        f"resident before {base:,} B"
    )
    for s, (peak, k, before) in enumerate(peaks):
        c = calls[k] if k >= 0 else None
        where = f"in op {k} {c.op} ({c.phase}), held before it {base + before:,}" if c else "outside ops"
        check = f" (max_memory_allocated {cuda_peaks[s]:,})" if cuda_peaks is not None else ""
        print(f"step {s}: peak {base + peak:,} B{check} {where}")
    print(
        f"{'step':>4} {'k':>5} {'phase':9} {'op':45} {'transient':>11} {'aft':3} {'excess':>11} "
        f"{'out_real':>11} {'out_fake':>11} {'peak?':5} inner / shapes"
    )
    groups: dict[Any, list[Call]] = defaultdict(list)
    for c in calls:
        differs = c.out_fake is not None and c.out_real != c.out_fake
        if (
            c.transient >= a.min_bytes
            or (differs and abs(c.out_real - c.out_fake) >= a.min_bytes)
            or c.fake_error
        ):
            groups[(c.op, _shapes(c.args))].append(c)
    peak_ks = {k for _, k, _ in peaks}
    for (op, shapes), cs in groups.items():
        shown = cs if a.all else cs[:1]
        for c in shown:
            fake = "ERR" if c.out_fake is None else f"{c.out_fake:,}"
            n = "" if a.all or len(cs) == 1 else f" x{len(cs)}"
            print(
                f"{c.step:>4} {c.k:>5} {c.phase:9} {str(op)[:45]:45} {c.transient:>11,} "
                f"{'y' if c.after_out else 'n':3} {c.excess:>11,} {c.out_real:>11,} {fake:>11} "
                f"{'PEAK' if c.k in peak_ks else '':5} {c.inner} / {shapes}{n} {c.fake_error}"
            )
    for k in a.show:
        c = calls[k]
        print(
            f"--- op {k} {c.op} args {_shapes(c.args)} outputs {[o.nbytes if o else None for o in c.outputs]}"
        )
        for size, ptr, inner in c.events:
            print(f"    {size:>14,} {ptr:#x} {inner}")
    if a.json:
        rows = [
            {
                "k": c.k,
                "step": c.step,
                "phase": c.phase,
                "op": str(c.op),
                "args": _jsonable(c.args),
                "kwargs": _jsonable(c.kwargs),
                "outputs": _jsonable(c.outputs),
                "transient": c.transient,
                "after_out": c.after_out,
                "excess": c.excess,
                "inner": c.inner,
                "out_real": c.out_real,
                "new_out_real": c.new_out_real,
                "out_fake": c.out_fake,
                "extra": c.extra,
                "freed_old": c.freed_old,
                "held_before": base + c.held_before,
                "held_max": base + c.held_max,
            }
            for c in calls
        ]
        meta = device_meta(a.device) | {
            "model": a.model,
            "batch_size": a.batch_size,
            "optimizer": a.optimizer,
            "precision": a.precision,
            "resident": base,
            "peaks": [base + p for p, _, _ in peaks],
            "peak_ops": [k for _, k, _ in peaks],
            "max_memory_allocated": cuda_peaks,
        }
        a.json.write_text(json.dumps({"meta": meta, "calls": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
