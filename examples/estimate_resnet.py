"""Estimate one training step of torchvision's resnet18, then measure it, and compare.

Batch 8 of 3x224x224 images, cross entropy, Adam, float32, on the CPU. The estimate runs the step on
fake tensors (no real memory, no real compute); the measurement runs two real steps under PyTorch's
profiler. Runs in well under a minute on a laptop CPU:

    python examples/estimate_resnet.py
"""

from __future__ import annotations

import os

from lightning_memest.cases import InputSpec, build_case, estimate_case, measure_case
from lightning_memest.report import format_bytes


def main() -> None:
    # Quiet the profiler that measures the real steps: it logs its start and stop (and, on machines
    # without a GPU, a failed GPU count) to stderr. Read when it starts; a setting of your own wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    inputs = InputSpec(batch_size=8, shape=(3, 224, 224))
    # build_case seeds the RNG, builds resnet18 with weights=None (no download), makes the batch and
    # a cross-entropy target of the output's shape. Two identical cases: measuring trains in place.
    case = build_case("torchvision.models:resnet18", inputs, loss="cross_entropy", optimizer="adam")
    est = estimate_case(case)
    measured = measure_case(build_case("torchvision.models:resnet18", inputs, optimizer="adam"))

    print(f"resnet18, {inputs.describe()}, cross entropy, Adam, 32-true, CPU")
    print(f"{'peak':<14}{'estimated':>14}{'measured':>14}{'error':>10}")
    for label, e, m in (
        ("first step", est.first_step.bytes, measured.first_step),
        ("steady state", est.steady_state.bytes, measured.steady_state),
    ):
        print(f"{label:<14}{format_bytes(e):>14}{format_bytes(m):>14}{100 * (e - m) / m:>+9.2f}%")

    peak = est.steady_state
    print(f"\nat the steady-state peak ({peak.op} in {peak.module or '(root)'}, {peak.phase.value}):")
    for name, n in peak.breakdown.items():
        print(f"  {name:<18}{format_bytes(n):>12}")

    print("\nlayers whose forward saves the most for backward (first step):")
    modules = [m for m in est.modules.walk() if m.path and not m.children]
    for module in sorted(modules, key=lambda m: m.saved_bytes, reverse=True)[:5]:
        print(f"  {module.path:<18}{module.type_name:<14}{format_bytes(module.saved_bytes):>12}")

    print(f"\nestimate took {est.estimate_seconds:.2f} s; one real step took {measured.step_seconds:.2f} s")


if __name__ == "__main__":
    main()
