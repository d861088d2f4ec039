"""CPU ops whose kernel memory is measured on this machine whenever a step has them, calibration asked
for or not: ops no hand model describes, whose CPU kernels differ by instruction set and library build.

``aten._scaled_mm`` (Float8 training: torchao's ``Float8Linear``) is one: on a CPU without native fp8
matrix units its kernel works on float32 copies of both operands and of the product -- measured here
(AVX2): 2.4 MiB beyond the output for a 64 x 256 by 256 x 1024 product -- and a CPU with them takes
another path. Without a figure the estimate of a Float8 step read 11.6 % low at its steady state. Each
distinct signature runs once, alone, for real (``calibrate.calibrate_calls``, cached on disk per
machine like any calibration); where it cannot run (too large for the memory free now), the hand
models answer: nothing beyond its outputs.

Example:
    >>> import torch
    >>> from lightning_memest.accounting.kernels import OpCall, TensorMeta
    >>> a = TensorMeta.of(torch.empty(64, 256, dtype=torch.float8_e4m3fn))
    >>> b = TensorMeta.of(torch.empty(1024, 256, dtype=torch.float8_e4m3fn).t())
    >>> s, out = TensorMeta.of(torch.empty(())), TensorMeta.of(torch.empty(64, 1024, dtype=torch.bfloat16))
    >>> scaled_mm = torch.ops.aten._scaled_mm.default
    >>> call = OpCall(scaled_mm, (a, b, s, s), {"out_dtype": torch.bfloat16}, (out,), "cpu")
    >>> measured(call) and MeasuredOps(lambda call: None)(call).workspace_bytes > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_memest.accounting.kernels.calibrate import calibrate_calls, signature
from lightning_memest.accounting.kernels.model import KernelMemory
from lightning_memest.engine.events import OpCall

__all__ = ["MEASURED_CPU_OPS", "MeasuredOps", "measured"]

#: Ops measured on this machine's CPU at every signature a step has (see the module docstring).
MEASURED_CPU_OPS = frozenset({torch.ops.aten._scaled_mm.default})


def measured(call: OpCall) -> bool:
    """Whether ``call``'s kernel memory is measured on this machine rather than modelled."""
    return call.device_type == "cpu" and call.op in MEASURED_CPU_OPS


class MeasuredOps:
    """The kernel memory of a CPU simulation without a calibration: the measured figure of the calls
    :func:`measured` picks (each signature once per instance, from the disk cache where it is known),
    ``hand`` for every other call and where a measurement fails."""

    def __init__(self, hand: Callable[[OpCall], KernelMemory | None]) -> None:
        self.hand = hand
        self._memo: dict[str, KernelMemory | None] = {}

    def __call__(self, call: OpCall) -> KernelMemory | None:
        if not measured(call):
            return self.hand(call)
        key = signature(call)
        if key not in self._memo:
            found, result = calibrate_calls({key: call}, torch.device("cpu")).lookup(call)
            self._memo[key] = result if found else self.hand(call)
        return self._memo[key]
