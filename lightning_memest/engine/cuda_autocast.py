"""CUDA's autocast op lists, emulated on the CPU for a CUDA what-if.

A what-if runs the step on fake CPU tensors, so ``torch.autocast`` applies the *CPU* lists. CUDA's
differ where memory differs most in a transformer: CUDA runs normalizations, softmax, exponentials,
logarithms, powers and reductions in float32 (their outputs are float32, and saved for backward in
float32), where the CPU keeps the lower precision; and CUDA casts a few more matmul-like ops down.

:func:`cuda_autocast_lists` is a ``TorchFunctionMode`` that, while autocast is on, casts the floating
inputs of CUDA's float32 ops to float32 and those of its extra lower-precision ops to the autocast
dtype before the op runs -- what CUDA's autocast does (the casts are real copies, as CUDA's are).
The lists are PyTorch's AMP op reference for CUDA ("CUDA Ops that can autocast to float32" / "to
float16", which ``aten/src/ATen/autocast_mode.h`` registers for CUDA with either lower dtype), less
what the CPU lists already do (losses, ``linear``, convolutions, ``matmul``, ``bmm``...).

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> x = torch.randn(4, 8)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast_lists():
    ...     h = F.linear(x, torch.randn(8, 8))
    ...     (h.dtype, F.layer_norm(h, (8,)).dtype, h.softmax(-1).dtype)
    (torch.bfloat16, torch.float32, torch.float32)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

__all__ = ["CUDA_FP32_ONLY", "CUDA_LOWER_ONLY", "autocast_cast", "cuda_autocast_lists"]

#: CUDA's float32 list less the CPU's: function and method names.
CUDA_FP32_ONLY = frozenset(
    {
        "__pow__",
        "__rpow__",
        "__rdiv__",
        "__rtruediv__",
        "pow",
        "acos",
        "asin",
        "cosh",
        "sinh",
        "tan",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log1p",
        "log2",
        "reciprocal",
        "rsqrt",
        "layer_norm",
        "group_norm",
        "norm",
        "normalize",
        "softmax",
        "log_softmax",
        "softmin",
        "softplus",
        "sum",
        "prod",
        "cumsum",
        "cumprod",
        "cosine_similarity",
        "dist",
        "pdist",
        "renorm",
    }
)
#: CUDA's lower-precision list less the CPU's.
CUDA_LOWER_ONLY = frozenset({"addmv", "addr", "einsum", "mv", "chain_matmul", "multi_dot"})


class _CudaAutocastLists(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if torch.is_autocast_enabled("cpu") and "dtype" not in kwargs:
            name = getattr(func, "__name__", "")
            target: torch.dtype | None = None
            if name in CUDA_FP32_ONLY:
                target = torch.float32
            elif name in CUDA_LOWER_ONLY:
                target = torch.get_autocast_dtype("cpu")
            if target is not None:
                cast = functools.partial(autocast_cast, dtype=target)
                args, kwargs = tree_map_only(Tensor, cast, (tuple(args), kwargs))
        return func(*args, **kwargs)


def autocast_cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as autocast casts an op's input to ``dtype``: floating tensors of the other precisions
    only (not float64, not integers)."""
    if t.is_floating_point() and t.dtype != dtype and t.dtype != torch.float64:
        return t.to(dtype)
    return t


@contextmanager
def cuda_autocast_lists() -> Iterator[None]:
    """Inside, CPU autocast follows CUDA's op lists (see the module docstring)."""
    with _CudaAutocastLists():
        yield
