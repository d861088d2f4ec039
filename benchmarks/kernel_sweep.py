"""Sweep the CPU kernel models over configurations: what each op's real kernel allocates beyond its fake
outputs (measured on this machine) against what the hand model says.

Each configuration (a convolution, a linear layer, a batched matmul, an LSTM, a normalization, a mean)
runs forward and backward once on fake tensors; the kernel-model ops it calls are recorded as the
estimator records them (``OpCall``: argument metadata, outputs as the fake run sizes them). Each call is
then run alone on zero-filled real tensors of exactly that metadata, inside the CPU allocator's profiler
(as ``accounting/kernels/calibrate.py`` measures: the highest point inside the op above what existed
before it, less what it leaves), and compared with ``kernel_memory(call)``.

Excess = transient workspace + bytes of outputs the real kernel makes bigger than the fake one says (the
LSTM workspace; an output the fake kernel aliases but the real one allocates). Prints a markdown table
(configuration | op | measured excess | modelled | error bytes) and a summary, and writes both into
``benchmarks/KERNELS.md`` under a heading naming this machine (CPU capability, bf16/AMX flags, threads),
replacing that machine's previous section.

    KINETO_LOG_LEVEL=6 python benchmarks/kernel_sweep.py [--quick] [--only REGEX] [--json out.json]
        [--no-write]

About 6 minutes on 2 cores (``--quick``: under a minute).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own log lines, before torch loads it

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_memest.accounting.kernels import KernelMemory, OpCall, TensorMeta, kernel_memory
from lightning_memest.accounting.kernels.op_runs import Guard
from lightning_memest.allocator_events import CpuMemoryProfile, quiet_gc, window_figures
from lightning_memest.machine import cpu_flags

__all__ = ["Config", "Row", "configs", "machine_heading", "main", "measure", "record"]

aten = torch.ops.aten
KERNELS_MD = Path(__file__).resolve().parent / "KERNELS.md"
_WINDOW = "memest_sweep_"
#: The ops whose kernel memory the sweep compares (every op a CPU hand model exists for, and bmm).
OPS = frozenset(
    {
        aten.convolution,
        aten.convolution_backward,
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.mkldnn_rnn_layer,
        aten.mkldnn_rnn_layer_backward,
        aten.native_batch_norm,
        aten._native_batch_norm_legit,
        aten.native_batch_norm_backward,
        aten.native_layer_norm,
        aten.native_layer_norm_backward,
        aten.mean,
        aten.embedding_dense_backward,
    }
)
_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


# ------------------------------------------------------------------------------------ configurations


@dataclass(frozen=True)
class Config:
    """One configuration: ``run`` does a forward and a backward on tensors it makes (fake ones here)."""

    family: str
    name: str
    run: Callable[[], None]
    quick: bool = False


def _leaf(*shape: int, dtype: torch.dtype, grad: bool = True, cl: bool = False) -> Tensor:
    t = torch.zeros(shape, dtype=dtype)
    if cl:
        t = t.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    return t.requires_grad_(grad)


def _backward(y: Tensor) -> None:
    # The gradient a next layer hands back: dense, in the output's own layout.
    y.backward(torch.empty_like(y))


def _conv(
    n: int,
    c: int,
    oc: int,
    size: tuple[int, ...],
    k: int,
    *,
    stride: int = 1,
    pad: int | None = None,
    dil: int = 1,
    groups: int = 1,
    dtype: torch.dtype = torch.float32,
    cl: bool = False,
    grad_input: bool = True,
    bias: bool = False,
    quick: bool = False,
) -> Config:
    dims = len(size)
    padding = dil * (k // 2) if pad is None else pad

    def run() -> None:
        x = _leaf(n, c, *size, dtype=dtype, grad=grad_input, cl=cl)
        w = _leaf(oc, c // groups, *([k] * dims), dtype=dtype, cl=cl)
        b = _leaf(oc, dtype=dtype) if bias else None
        conv = F.conv2d if dims == 2 else F.conv3d
        _backward(conv(x, w, b, stride, padding, dil, groups))

    kind = "dw" if groups == c == oc and groups > 1 else f"g{groups}"
    name = (
        f"{_SHORT[dtype]} {'cl' if cl else 'nchw'} {n}x{c}x{'x'.join(map(str, size))}->{oc} k{k} s{stride} "
        f"p{padding} d{dil} {kind}{' +b' if bias else ''}{'' if grad_input else ' no-gi'}"
    )
    return Config(f"conv{dims}d", name, run, quick)


def _linear(rows: tuple[int, ...], i: int, o: int, dtype: torch.dtype, *, sum_loss: bool = False) -> Config:
    def run() -> None:
        x = _leaf(*rows, i, dtype=dtype)
        y = F.linear(x, _leaf(o, i, dtype=dtype), _leaf(o, dtype=dtype))
        if sum_loss:
            y.sum().backward()  # sum's backward: a stride-0 expanded gradient
        else:
            _backward(y)

    shape = "x".join(map(str, rows))
    return Config("matmul", f"linear {_SHORT[dtype]} {shape}x{i}->{o}{' sum' if sum_loss else ''}", run)


def _bmm(b: int, m: int, k: int, n: int, dtype: torch.dtype, *, transposed: bool = False) -> Config:
    def run() -> None:
        x = _leaf(b, m, k, dtype=dtype)
        y = _leaf(b, n, k, dtype=dtype).transpose(1, 2) if transposed else _leaf(b, k, n, dtype=dtype)
        _backward(torch.bmm(x, y))

    return Config("matmul", f"bmm {_SHORT[dtype]} {b}x{m}x{k} @ {k}x{n}{' (t)' if transposed else ''}", run)


def _lstm(
    i: int,
    h: int,
    *,
    t: int = 32,
    n: int = 4,
    layers: int = 1,
    bidirectional: bool = False,
    batch_first: bool = False,
    dtype: torch.dtype = torch.float32,
    quick: bool = False,
) -> Config:
    def run() -> None:
        lstm = torch.nn.LSTM(i, h, layers, bidirectional=bidirectional, batch_first=batch_first, dtype=dtype)
        x = _leaf(*((n, t, i) if batch_first else (t, n, i)), dtype=dtype)
        out, _ = lstm(x)
        _backward(out)

    name = (
        f"{_SHORT[dtype]} T{t} N{n} {i}->{h} x{layers}{' bi' if bidirectional else ''}"
        f"{' batch_first' if batch_first else ''}"
    )
    return Config("lstm", name, run, quick)


def _batch_norm(n: int, c: int, hw: int, dtype: torch.dtype, param_dtype: torch.dtype) -> Config:
    def run() -> None:
        x = _leaf(n, c, hw, hw, dtype=dtype)
        w, b = _leaf(c, dtype=param_dtype), _leaf(c, dtype=param_dtype)
        rm, rv = torch.zeros(c, dtype=param_dtype), torch.ones(c, dtype=param_dtype)
        _backward(F.batch_norm(x, rm, rv, w, b, training=True))

    name = f"batch_norm {_SHORT[dtype]} (params {_SHORT[param_dtype]}) {n}x{c}x{hw}x{hw}"
    return Config("norm", name, run)


def _layer_norm(shape: tuple[int, ...], dtype: torch.dtype, *, strided: bool = False) -> Config:
    def run() -> None:
        x = _leaf(*shape, dtype=dtype)
        if strided:
            x = x.transpose(0, 1)
        c = x.shape[-1]
        _backward(F.layer_norm(x, (c,), _leaf(c, dtype=dtype), _leaf(c, dtype=dtype)))

    name = f"layer_norm {_SHORT[dtype]} {'x'.join(map(str, shape))}{' transposed' if strided else ''}"
    return Config("norm", name, run)


def _mean(shape: tuple[int, ...], dims: tuple[int, ...], dtype: torch.dtype) -> Config:
    def run() -> None:
        _backward(_leaf(*shape, dtype=dtype).mean(dims, keepdim=True))

    return Config("reduce", f"mean {_SHORT[dtype]} {'x'.join(map(str, shape))} over {dims}", run)


def _conv_configs() -> Iterator[Config]:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for dtype in (f32, bf16, f16):
        for cl in (False, True):
            q = dtype != f16 and not cl
            yield _conv(2, 64, 64, (28, 28), 3, dtype=dtype, cl=cl, quick=q)
            yield _conv(2, 64, 128, (28, 28), 3, stride=2, dtype=dtype, cl=cl)
            yield _conv(2, 64, 256, (28, 28), 1, pad=0, dtype=dtype, cl=cl, quick=q)
            yield _conv(2, 64, 128, (28, 28), 1, stride=2, pad=0, dtype=dtype, cl=cl)
            yield _conv(2, 256, 64, (14, 14), 1, pad=0, dtype=dtype, cl=cl)
            yield _conv(2, 24, 40, (28, 28), 3, dtype=dtype, cl=cl)  # channels not a multiple of 16
            yield _conv(2, 64, 64, (28, 28), 3, pad=0, dtype=dtype, cl=cl)
            yield _conv(2, 64, 64, (28, 28), 3, dtype=dtype, cl=cl, bias=True)
            yield _conv(2, 3, 64, (64, 64), 7, stride=2, dtype=dtype, cl=cl, grad_input=False)  # a stem
            yield _conv(2, 3, 32, (64, 64), 3, stride=2, dtype=dtype, cl=cl, grad_input=False)
            yield _conv(2, 32, 32, (28, 28), 7, dtype=dtype, cl=cl)
            # depthwise and grouped
            yield _conv(2, 96, 96, (28, 28), 3, groups=96, dtype=dtype, cl=cl, quick=q)
            yield _conv(2, 96, 96, (28, 28), 3, stride=2, groups=96, dtype=dtype, cl=cl)
            yield _conv(2, 96, 96, (14, 14), 5, groups=96, dtype=dtype, cl=cl)
            yield _conv(2, 96, 96, (14, 14), 7, groups=96, dtype=dtype, cl=cl)
            yield _conv(2, 64, 64, (28, 28), 3, groups=4, dtype=dtype, cl=cl)
            yield _conv(2, 64, 128, (28, 28), 3, stride=2, groups=32, dtype=dtype, cl=cl)
            # dilation: DeepLab's ASPP (960 -> 256 on 8x8 maps at rates 12-36) and dilated backbones
            for dil in (2, 6, 12, 24, 36):
                yield _conv(
                    2,
                    960 if dil >= 12 else 256,
                    256,
                    (8, 8),
                    3,
                    dil=dil,
                    dtype=dtype,
                    cl=cl,
                    quick=q and dil in (6, 12),
                )
            for dil in (2, 6, 12):
                yield _conv(2, 64, 64, (28, 28), 3, dil=dil, dtype=dtype, cl=cl, quick=q and dil == 12)
            yield _conv(2, 160, 160, (8, 8), 5, dil=2, groups=160, dtype=dtype, cl=cl)  # dilated depthwise
            yield _conv(2, 128, 128, (16, 16), 3, dil=4, groups=128, dtype=dtype, cl=cl)
    for dtype in (f32, bf16):
        yield _conv(2, 32, 32, (4, 14, 14), 3, dtype=dtype, quick=dtype == f32)
        yield _conv(2, 32, 64, (4, 14, 14), 3, stride=2, dtype=dtype)
        yield _conv(2, 32, 64, (4, 14, 14), 1, stride=2, pad=0, dtype=dtype)
        yield _conv(2, 3, 32, (4, 28, 28), 3, dtype=dtype, grad_input=False)
        yield _conv(2, 64, 64, (2, 7, 7), 3, dtype=dtype)  # shallower than the kernel (r3d_18's last stages)


def configs() -> list[Config]:
    """Every configuration of the sweep, in the table's order."""
    out = list(_conv_configs())
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for dtype in (f32, bf16, f16):
        out += [
            _linear((64,), 256, 512, dtype),
            _linear((4, 128), 256, 1024, dtype),
            _linear((8, 64), 1024, 1000, dtype),
            _linear((512,), 64, 256, dtype, sum_loss=True),
            _bmm(16, 128, 64, 128, dtype),
            _bmm(16, 128, 128, 64, dtype, transposed=True),
        ]
    out = [
        Config(
            c.family, c.name, c.run, c.quick or (c.family == "matmul" and not re.search(r"\bf16\b", c.name))
        )
        for c in out
    ]
    for dtype in (f32, bf16):
        q = True
        for h in (64, 256, 512, 1024):
            out.append(_lstm(128 if h < 1024 else 256, h, dtype=dtype, quick=q and h in (64, 512)))
        out.append(_lstm(256, 512, t=128, n=4, dtype=dtype))  # the LM's first layer
        out.append(_lstm(100, 200, t=16, n=3, dtype=dtype))
        out.append(_lstm(128, 256, layers=2, dtype=dtype, quick=q))
        out.append(_lstm(128, 256, bidirectional=True, dtype=dtype, quick=q))
        out.append(_lstm(128, 128, layers=2, bidirectional=True, batch_first=True, dtype=dtype))
        out.append(_lstm(64, 128, batch_first=True, dtype=dtype))
        out.append(_lstm(32, 1024, t=8, n=2, dtype=dtype))
    for dtype, param in ((f32, f32), (bf16, bf16), (bf16, f32)):
        out.append(_batch_norm(4, 64, 28, dtype, param))
    for dtype in (f32, bf16):
        out.append(_layer_norm((4, 64, 256), dtype))
        out.append(_layer_norm((64, 4, 256), dtype, strided=True))
    for dtype in (f32, bf16, f16):
        out.append(_mean((4, 512, 7, 7), (-1, -2), dtype))
        out.append(_mean((4, 128, 256), (1,), dtype))
    return out


# ------------------------------------------------------------------------------------- recording


class _Recorder(TorchDispatchMode):
    """Records the calls of :data:`OPS` as the estimator's tracker records them (``OpCall``), and, per
    call, which outputs alias an input or an earlier output in the fake run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[OpCall, tuple[bool, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in OPS:

            def meta(v: Any) -> Any:
                return TensorMeta.of(v) if isinstance(v, Tensor) else v

            seen = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
            aliased = []
            for t in tree_leaves(out):
                key = t.untyped_storage()._cdata if isinstance(t, Tensor) else None
                aliased.append(key in seen)
                seen.add(key)
            call = OpCall(
                func,
                tuple(tree_map(meta, a) for a in args),
                {k: tree_map(meta, v) for k, v in kwargs.items()},
                tuple(TensorMeta.of(t) if isinstance(t, Tensor) else None for t in tree_leaves(out)),
                "cpu",
            )
            self.calls.append((call, tuple(aliased)))
        return out


def record(config: Config) -> list[tuple[OpCall, tuple[bool, ...]]]:
    """The kernel-model calls of ``config``'s forward and backward on fake CPU tensors."""
    recorder = _Recorder()
    with FakeTensorMode(), recorder:
        config.run()
    return recorder.calls


# ------------------------------------------------------------------------------------------- measuring


@dataclass
class Row:
    family: str
    config: str
    op: str
    measured: KernelMemory | str | None  # a string: the op failed for real
    modelled: KernelMemory | None
    call: OpCall = field(repr=False)

    @staticmethod
    def total(km: KernelMemory | None) -> int:
        if km is None:
            return 0
        return km.workspace_bytes + sum(km.extra_output_bytes or ())

    @property
    def error(self) -> int | None:
        if isinstance(self.measured, str):
            return None
        return self.total(self.modelled) - self.total(self.measured)


def measure(calls: list[tuple[OpCall, tuple[bool, ...]]]) -> list[KernelMemory | str | None]:
    """Each call run alone on zero-filled real tensors (inputs made before its window, outputs dropped
    after it): the highest point above what existed before, less what it left, and per output the bytes
    the real one has beyond the fake one (an output the fake kernel aliases counts whole when the real
    kernel allocates it)."""
    guard = Guard()
    outcomes: list[tuple[list[tuple[int, int] | None], set[int]] | str] = []
    # Grad mode stays on, as in training (no input requires grad, so nothing is recorded): under
    # no_grad mkldnn_rnn_layer returns no workspace at all.
    with quiet_gc(), torch.autocast("cpu", enabled=False), CpuMemoryProfile() as prof:
        for i, (call, _) in enumerate(calls):
            failure: str | None = None if guard.safe(call) else "an input of unknown real size"
            args: Any = ()
            kwargs: dict[str, Any] = {}
            held: set[int] = set()
            if failure is None:
                args, kwargs, held = guard.inputs(call, torch.device("cpu"))
            with record_function(f"{_WINDOW}{i}"):
                if failure is None:
                    try:
                        out = call.op(*args, **kwargs)
                    except Exception as exc:
                        failure = f"{type(exc).__name__}"
            if failure is None:
                sizes = [
                    (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                    if isinstance(t, Tensor)
                    else None
                    for t in tree_leaves(out)
                ]
                del out
                outcomes.append((sizes, held))
                extra = _extra(call, calls[i][1], sizes, held)
                guard.note(call, KernelMemory(0, True, extra), measured=True)
            else:
                outcomes.append(failure)
                hand = kernel_memory(call)
                guard.note(call, hand, measured=False)
            del args, kwargs
    windows = window_figures(prof.timeline(), _WINDOW, len(calls))
    results: list[KernelMemory | str | None] = []
    for (call, aliased), outcome, w in zip(calls, outcomes, windows, strict=True):
        if isinstance(outcome, str):
            results.append(outcome)
            continue
        sizes, held = outcome
        extra = _extra(call, aliased, sizes, held)
        workspace = max(0, w.peak_rise - (w.end - w.start))
        results.append(None if workspace == 0 and extra is None else KernelMemory(workspace, True, extra))
    return results


def _extra(
    call: OpCall, aliased: tuple[bool, ...], sizes: list[tuple[int, int] | None], held: set[int]
) -> tuple[int, ...] | None:
    extra: list[int] = []
    seen = set(held)
    for fake, real, alias in zip(call.outputs, sizes, aliased, strict=False):
        if fake is None or real is None or real[0] in seen or real[0] == 0:
            extra.append(0)
            continue
        seen.add(real[0])
        extra.append(real[1] if alias else max(0, real[1] - fake.nbytes))
    return tuple(extra) if any(extra) else None


def run_sweep(selected: list[Config], verbose: bool = False) -> list[Row]:
    rows: list[Row] = []
    for config in selected:
        if verbose:
            print(f"{config.family} {config.name}", file=sys.stderr, flush=True)
        calls = record(config)
        results = measure(calls)
        for (call, _), result in zip(calls, results, strict=True):
            op = str(call.op).removeprefix("aten.").removesuffix(".default")
            rows.append(Row(config.family, config.name, op, result, kernel_memory(call), call))
    return rows


# --------------------------------------------------------------------------------------------- output


def _fmt(km: KernelMemory | str | None) -> str:
    if isinstance(km, str):
        return f"failed ({km})"
    if km is None:
        return "0"
    text = f"{km.workspace_bytes:,}"
    if km.extra_output_bytes is not None and any(km.extra_output_bytes):
        text += f" + out {sum(km.extra_output_bytes):,}"
    return text


def table(rows: list[Row]) -> str:
    lines = [
        "| configuration | op | measured excess | modelled | error bytes |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        err = r.error
        lines.append(
            f"| {r.family} {r.config} | {r.op} | {_fmt(r.measured)} | {_fmt(r.modelled)} | "
            f"{'—' if err is None else f'{err:+,}'} |"
        )
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    done = [r for r in rows if r.error is not None]
    exact = sum(1 for r in done if r.error == 0)
    near = sum(1 for r in done if r.error != 0 and abs(r.error or 0) <= 1024)
    off = [r for r in done if abs(r.error or 0) > 1024]
    lines = [
        f"{len(rows)} calls: **{exact} exact, {near} within 1 KB, {len(off)} off** "
        f"({len(rows) - len(done)} failed to run); sum |error| {sum(abs(r.error or 0) for r in done):,} B.",
    ]
    families: dict[str, list[int]] = {}
    for r in done:
        f = families.setdefault(r.family, [0, 0, 0])
        f[0 if r.error == 0 else 1 if abs(r.error or 0) <= 1024 else 2] += 1
    lines.append(
        "Per family (exact / within 1 KB / off): "
        + ", ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in sorted(families.items()))
        + "."
    )
    worst = sorted(off, key=lambda r: -abs(r.error or 0))[:8]
    if worst:
        lines.append("Worst: " + "; ".join(f"{r.family} {r.config} {r.op} {r.error:+,}" for r in worst) + ".")
    return "\n\n".join(lines)


def machine_heading() -> str:
    """``Kernel sweep: <capability>, <flags>, <n> threads`` -- the machine part of the section heading."""
    flags = [f for f in cpu_flags() if "bf16" in f or "amx" in f or "fp16" in f]
    return (
        f"Kernel sweep: {torch.backends.cpu.get_cpu_capability()}, "
        f"{'+'.join(flags) if flags else 'no native bf16'}, {torch.get_num_threads()} threads"
    )


def write_section(path: Path, body: str) -> None:
    """Put ``body`` under this machine's heading in ``path``, replacing that machine's earlier section."""
    machine = machine_heading()
    heading = f"## {machine} ({datetime.date.today().isoformat()})"
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(rf"^## {re.escape(machine)} \(.*?(?=^## |\Z)", re.S | re.M)
    section = f"{heading}\n\n{body.rstrip()}\n\n"
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n")


def _onednn() -> str:
    match = re.search(r"MKL-DNN v([0-9.]+)", torch.__config__.show())
    return match.group(1) if match else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short subset")
    parser.add_argument("--only", help="configurations whose 'family name' matches this regex")
    parser.add_argument("--json", help="also write the rows (with each call's arguments) here")
    parser.add_argument("--verbose", action="store_true", help="name each configuration as it runs")
    parser.add_argument("--no-write", action="store_true", help=f"do not update {KERNELS_MD.name}")
    args = parser.parse_args(argv)
    selected = [c for c in configs() if c.quick or not args.quick]
    if args.only:
        selected = [c for c in selected if re.search(args.only, f"{c.family} {c.name}")]
    start = time.perf_counter()
    rows = run_sweep(selected, args.verbose)
    seconds = time.perf_counter() - start
    text = table(rows)
    head = (
        f"`python benchmarks/kernel_sweep.py{' --quick' if args.quick else ''}`: {len(selected)} "
        f"configurations in {seconds:.0f} s; torch {torch.__version__}, oneDNN "
        f"{_onednn()}, "
        f"flags {', '.join(cpu_flags()) or 'none'}. Measured = the op run alone on real tensors (transient "
        f"excess + bytes of outputs bigger than the fake ones); modelled = `kernel_memory(call)`; error = "
        f"modelled - measured."
    )
    body = f"{head}\n\n{summary(rows)}\n\n{text}"
    print(body)
    if args.json:
        Path(args.json).write_text(json.dumps([_row_json(r) for r in rows], indent=1))
    if not args.no_write and not args.only:
        write_section(KERNELS_MD, body)
    return 0


def _row_json(r: Row) -> dict[str, Any]:
    def enc(v: Any) -> Any:
        if isinstance(v, TensorMeta):
            return {"shape": v.shape, "stride": v.stride, "dtype": str(v.dtype), "nbytes": v.nbytes}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        return v if isinstance(v, (int, float, bool, str)) or v is None else repr(v)

    def km(v: KernelMemory | str | None) -> Any:
        if v is None or isinstance(v, str):
            return v
        return [v.workspace_bytes, list(v.extra_output_bytes) if v.extra_output_bytes else None]

    return {
        "family": r.family,
        "config": r.config,
        "op": r.op,
        "measured": km(r.measured),
        "modelled": km(r.modelled),
        "error": r.error,
        "args": enc(r.call.args),
        "outputs": enc(r.call.outputs),
    }


if __name__ == "__main__":
    sys.exit(main())
