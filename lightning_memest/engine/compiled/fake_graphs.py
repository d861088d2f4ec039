"""The code inductor generated, run on fake tensors: its buffer plan, without its kernels.

Inductor compiles each graph into a Python wrapper (``call(args)``) that allocates every buffer
(``empty_strided_cpu``), reuses one for another (``buf3 = buf0; del buf0  # reuse``), frees each after
its last use (``del buf1``), and between those calls kernels: generated C++ or Triton (which write
through data pointers) and library ones (``extern_kernels.mm(a, b, out=buf0)``, aten fallbacks). Run on
fake tensors with the generated kernels left out, the wrapper makes the real run's allocations and
frees in the real run's order -- the memory of a compiled step, as the event stream of any other step
(``engine.tracker``) -- and the library kernels run as aten ops, whose scratch memory the kernel models
know. The generated kernels allocate nothing through the allocator: their outputs are the wrapper's
buffers.

While :func:`inductor_graphs_on_fake` is on, a compiled graph called with fake tensors runs so; with
real tensors it runs as always. Each graph's module namespace is switched for the call only:

* every kernel the wrapper defines (``name = async_compile.cpp_pybinding(...)``, ``.triton(...)``, ...)
  does nothing;
* the allocators (``empty_strided_cpu``, ``_cuda``...) allocate through dispatch, so they make fake
  tensors, and ``reinterpret_tensor`` (a C++ alias that bypasses dispatch) is an ``as_strided`` view;
* ``assert_alignment`` (it reads data pointers) checks nothing.

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> net = torch.compile(torch.nn.Linear(4, 4))
    >>> with inductor_graphs_on_fake(), FakeTensorMode(allow_non_fake_inputs=True):  # doctest: +SKIP
    ...     out = net(torch.randn(2, 4))  # compiles for real, runs the plan on fake tensors
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["inductor_graphs_on_fake", "kernel_names"]

#: A kernel the wrapper defines: ``cpp_fused_relu_0 = async_compile.cpp_pybinding([...], '''...''')``.
_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(", re.MULTILINE)
#: The wrapper's allocators (``torch._C._dynamo.guards._empty_strided_<device>``): they allocate for real.
_ALLOCATORS = {
    "empty_strided_cpu": "cpu",
    "empty_strided_cpu_pinned": "cpu",
    "empty_strided_cuda": "cuda",
    "empty_strided_xpu": "xpu",
    "empty_strided_mtia": "mtia",
}


def kernel_names(source: str) -> tuple[str, ...]:
    """The names of the kernels a generated wrapper's ``source`` defines.

    >>> kernel_names("cpp_fused_add_0 = async_compile.cpp_pybinding(['float*'], r'''...''')\\nbuf = 1")
    ('cpp_fused_add_0',)
    """
    return tuple(_KERNEL.findall(source))


@contextmanager
def inductor_graphs_on_fake(on_graph: Callable[[str], None] | None = None) -> Iterator[None]:
    """While inside, inductor's compiled graphs called with fake tensors run their buffer plan on them
    (see the module docstring); ``on_graph`` gets each such graph's name (its AOT id: ``0_forward``)."""
    from torch._inductor.output_code import CompiledFxGraph

    original = CompiledFxGraph.__call__

    def call(self: CompiledFxGraph, inputs: Sequence[Any]) -> Any:
        if not any(isinstance(t, FakeTensor) for t in inputs):
            return original(self, inputs)
        if on_graph is not None:
            on_graph(_graph_name(self.source_code or ""))
        return _run_on_fake(self, inputs)

    CompiledFxGraph.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        CompiledFxGraph.__call__ = original  # type: ignore[method-assign]


def _run_on_fake(graph: Any, inputs: Sequence[Any]) -> Any:
    runner = graph.current_callable
    namespace: dict[str, Any] = getattr(runner, "__func__", runner).__globals__
    replacements: dict[str, Any] = {name: _no_kernel for name in kernel_names(graph.source_code or "")}
    for name, device in _ALLOCATORS.items():
        replacements[name] = _fake_allocator(device)
    replacements["reinterpret_tensor"] = _reinterpret
    replacements["assert_alignment"] = _no_kernel
    saved = {name: namespace[name] for name in replacements if name in namespace}
    namespace.update({name: value for name, value in replacements.items() if name in saved})
    try:
        return runner(inputs)
    finally:
        namespace.update(saved)


def _graph_name(source: str) -> str:
    found = re.search(r"^# AOT ID: \['([^']*)'\]", source, re.MULTILINE)
    return found.group(1) if found else "graph"


def _no_kernel(*args: Any, **kwargs: Any) -> None:
    """A generated kernel, left out: it writes values into buffers the wrapper made."""


def _fake_allocator(device: str) -> Callable[..., Tensor]:
    def empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return empty_strided


def _reinterpret(t: Tensor, size: Sequence[int], stride: Sequence[int], offset: int) -> Tensor:
    # torch/csrc/dynamo/guards.cpp _reinterpret_tensor: an alias at the base's offset plus ``offset``.
    return t.as_strided(size, stride, t.storage_offset() + offset)
