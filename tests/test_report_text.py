"""The library as a script meets it: printing a report gives a few readable lines, and library calls
write nothing of their own to the console (the profiler's C++ chatter included)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from lightning_memest import estimate_step
from lightning_memest.fx import profile_graph

SCRIPT = textwrap.dedent(
    """
    import torch, torchvision
    from lightning_memest import estimate_step, max_batch_size
    from lightning_memest.engine.step import StepConfig
    from lightning_memest.measure import measure_step

    model = torchvision.models.resnet18(weights=None)
    est = estimate_step(model, torch.randn(2, 3, 64, 64), optimizer=torch.optim.Adam)
    print(est)
    print(repr(est))
    print(est.modules)
    print(repr(est.flops))
    small = torch.nn.Linear(8, 4)
    print(measure_step(small, torch.randn(4, 8), StepConfig(optimizer=torch.optim.Adam)))
    print(measure_step(small, torch.randn(4, 8), StepConfig(optimizer=torch.optim.Adam)))
    print(max_batch_size(small, lambda n: torch.empty(n, 8, device="meta"), 2**20))
    """
)


def test_print_of_a_report_is_short_and_library_calls_are_quiet() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no profiler_start/stop, gpuGetDeviceCount, allocator warnings
    lines = proc.stdout.splitlines()
    assert len(proc.stdout) < 2000, proc.stdout  # was 256,332 characters for one estimate
    assert lines[0] == "Estimated train step (cpu, 32-true)"
    assert lines[1].startswith("  peak, first step:   ") and " MiB in step 1 (" in lines[1]
    assert lines[3].startswith("  at that peak: parameters 44.59 MiB, ")
    assert lines[4].startswith("  FLOPs: forward ")
    assert lines[5].startswith("<StepEstimate cpu 32-true: step 1 ") and " modules, " in lines[5]
    assert lines[6].startswith("(root) (ResNet): parameters 44.59 MiB, saved for backward ")
    assert lines[7].startswith("<FlopCount forward ")
    assert lines[8].startswith("measured on cpu: step 1 ") and lines[9].startswith("measured on cpu: ")
    assert lines[10].startswith("the largest batch size within 1.00 MiB is ")


def test_reprs_count_what_they_would_list() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(50)))
    est = estimate_step(model, torch.randn(4, 16), steps=1)
    assert len(repr(est)) < 200 and "51 modules" in repr(est)
    assert len(repr(est.modules)) < 200 and "50 modules below" in repr(est.modules)
    assert est.flops is not None and len(repr(est.flops)) < 200
    profile = profile_graph(model, torch.randn(4, 16))
    assert repr(profile).startswith("<GraphProfile cpu 32-true: 52 nodes, saved 12,544 B")  # 50 + in, out
    assert str(profile).startswith("Node profile (cpu, 32-true; first step): 52 nodes save 12.25 KiB")
