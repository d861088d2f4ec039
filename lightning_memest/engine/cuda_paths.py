"""CUDA's code paths in a CUDA what-if: where a composite op decomposes differently on CUDA, take CUDA's
branch on the fake CPU tensors the what-if runs on.

Why a what-if needs this: without a GPU the step runs on fake *CPU* tensors (backward on fake CUDA
tensors stops in the autograd engine, NOTES.md), so every composite op takes its CPU branch. The ATen
composites whose branch depends on the device and changes what is saved for backward (read from
``aten/src/ATen/native``, torch 2.14; each checked against what the CUDA dispatch saves, on fake CUDA
tensors, in ``tests/test_cuda_paths.py``):

* ``dropout`` (``Dropout.cpp``): ``is_fused_kernel_acceptable`` -- a CUDA (XPU, lazy, privateuse1)
  input, ``0 < p < 1``, a non-empty input, training -- takes ``native_dropout``, which saves a **bool**
  mask; the CPU's ``_dropout_impl`` multiplies by noise of the input's dtype and saves that (4x the bytes
  in float32, 2x in bf16). ``dropout_`` (in place), ``feature_dropout`` (``Dropout2d``...) and
  ``alpha_dropout`` take the same path on both devices. **Taken here**: ``F.dropout`` and ``torch.dropout``
  call ``torch.native_dropout`` where CUDA's fused kernel would run.
* ``scaled_dot_product_attention`` (``attention.cpp``): CUDA picks among flash, memory-efficient, cuDNN
  and math by the GPU, the inputs and the user's flags (``torch.backends.cuda.enable_flash_sdp`` and the
  others, which ``torch.nn.attention.sdpa_kernel`` sets for a block of code); the CPU has flash and math
  only and the same flags steer it (flash turned off sends it to math: a T x T softmax saved). **Taken
  here**: the CPU's flash kernel runs whatever the flags (one op, q, k, v and its output saved), with the
  flags as they were at the call recorded on the op (``OpCall.context``, ``"sdp_enabled"``, and the
  dropout probability, ``"dropout_p"``, which the CPU kernel does not take), so that the
  CUDA kernel model (``accounting.kernels.cuda_attention``) picks the backend CUDA would -- math too,
  with its T x T tensors -- and counts what it saves. Inputs the CPU kernel does not take (not 4-d,
  ``enable_gqa``) keep the plain path.
* ``_batch_norm_impl_index`` (``Normalization.cpp``): cuDNN's batch norm where its conditions hold,
  saving the same input, weight, statistics and a reserve space (0 bytes on fake CUDA tensors: cuDNN
  sizes it at run time); ``embedding``, ``cross_entropy``/``nll_loss``, ``layer_norm``: the same saved
  tensors on both devices. Nothing to take for these (checked in the tests).

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from lightning_memest.engine.tracker import Tracker
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> with cuda_code_paths(Tracker()):
    ...     y = F.dropout(x, 0.1)
    >>> type(y.grad_fn).__name__
    'NativeDropoutBackward0'
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_memest.engine.cuda_autocast import autocast_cast
from lightning_memest.engine.cuda_sdp_choice import AttentionCall, cuda_backend

if TYPE_CHECKING:
    from lightning_memest.engine.tracker import Tracker

__all__ = ["CUDA_PATHS", "cuda_code_paths", "sdp_enabled"]

#: A path: ``(tracker, args, kwargs) -> result``, or ``NotImplemented`` to take the plain path.
Path = Callable[["Tracker", Sequence[Any], Mapping[str, Any]], Any]

#: The functions whose CUDA branch the what-if takes, and how.
CUDA_PATHS: dict[Callable[..., Any], Path] = {}


def _path(*functions: Callable[..., Any]) -> Callable[[Path], Path]:
    def register(path: Path) -> Path:
        for fn in functions:
            if fn in CUDA_PATHS:
                raise ValueError(f"a second CUDA path for {fn}")
            CUDA_PATHS[fn] = path
        return path

    return register


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


@_path(F.dropout, torch.dropout)
def _fused_dropout(tracker: Tracker, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    x = args[0] if args else kwargs["input"]
    p = float(_arg(args, kwargs, 1, "p", 0.5))
    training = bool(_arg(args, kwargs, 2, "training" if "training" in kwargs else "train", True))
    inplace = bool(_arg(args, kwargs, 3, "inplace", False))
    # Dropout.cpp's is_fused_kernel_acceptable (the device is CUDA's in the what-if) and dropout()'s train
    if not (isinstance(x, Tensor) and training and not inplace and 0 < p < 1 and x.numel() > 0):
        return NotImplemented
    return torch.native_dropout(x, p, True)[0]


def sdp_enabled() -> frozenset[str]:
    """The SDP backends the user's flags allow now (``torch.backends.cuda.*_sdp_enabled()``; what
    ``sdpa_kernel`` sets): of ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``."""
    cuda = torch.backends.cuda
    flags = {
        "flash": cuda.flash_sdp_enabled(),  # type: ignore[no-untyped-call]
        "efficient": cuda.mem_efficient_sdp_enabled(),  # type: ignore[no-untyped-call]
        "cudnn": cuda.cudnn_sdp_enabled(),  # type: ignore[no-untyped-call]
        "math": cuda.math_sdp_enabled(),  # type: ignore[no-untyped-call]
    }
    return frozenset(name for name, on in flags.items() if on)


@_path(F.scaled_dot_product_attention)
def _attention(tracker: Tracker, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    q, k, v = (_arg(args, kwargs, i, name, None) for i, name in enumerate(("query", "key", "value")))
    mask = _arg(args, kwargs, 3, "attn_mask", None)
    dropout_p = float(_arg(args, kwargs, 4, "dropout_p", 0.0))
    is_causal = bool(_arg(args, kwargs, 5, "is_causal", False))
    scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
    gqa = bool(kwargs.get("enable_gqa", args[7] if len(args) > 7 else False))
    tensors = (q, k, v)
    if gqa or not all(isinstance(t, Tensor) and t.dim() == 4 and not t.is_nested for t in tensors):
        return NotImplemented
    if mask is not None and is_causal:
        return NotImplemented  # an error on every device: the plain path raises it
    before = tracker.op_context
    if torch.is_autocast_enabled("cpu"):  # CUDA's autocast runs attention in the lower precision
        low = torch.get_autocast_dtype("cpu")
        q, k, v = (autocast_cast(t, low) for t in (q, k, v))
    # (the CPU kernel takes no dropout: its probability goes with the flags, for the CUDA model)
    tracker.op_context = (*before, ("sdp_enabled", sdp_enabled()), ("dropout_p", dropout_p))
    try:
        return _CPU_FLASH(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)[0]
    finally:
        tracker.op_context = before


class _CudaPaths(TorchFunctionMode):
    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        path = CUDA_PATHS.get(func)
        if path is not None:
            out = path(self.tracker, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


@contextmanager
def cuda_code_paths(tracker: Tracker, capability: tuple[int, int] | None = None) -> Iterator[None]:
    """Inside: the CUDA branches of :data:`CUDA_PATHS` are taken (a CUDA what-if's step),
    ``flex_attention`` takes gradients as on CUDA (:func:`_flex_attention_as_cuda`), and selective
    checkpointing's policies are shown the attention op CUDA would run on a GPU of ``capability``
    (:func:`_policies_see_cuda_ops`; ``None``: an A100, as the accounting assumes)."""
    with _CudaPaths(tracker), _flex_attention_as_cuda(), _policies_see_cuda_ops(tracker, capability):
        yield


#: The op CUDA's SDPA dispatches to, per backend (math decomposes into ops the CPU flash kernel does not
#: show: a policy sees the CPU op there).
_CUDA_ATTENTION_OPS = {
    "flash": torch.ops.aten._scaled_dot_product_flash_attention.default,
    "efficient": torch.ops.aten._scaled_dot_product_efficient_attention.default,
    "cudnn": torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _cuda_attention_op(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    context: Sequence[tuple[str, Any]],
    capability: tuple[int, int] | None,
) -> Any:
    """The op CUDA's dispatcher runs for the what-if's CPU flash attention call (``args``, ``kwargs``,
    and the flags and dropout :func:`_attention` recorded in ``context``), or the CPU op itself where
    CUDA would take math."""
    q, k, v = args[:3]
    noted = dict(context)
    call = AttentionCall.of(  # (inside a checkpointed region of a training step: inputs need grad)
        q,
        k,
        v,
        has_mask=kwargs.get("attn_mask") is not None,
        is_causal=bool(_arg(args, kwargs, 4, "is_causal", False)),
        dropout_p=float(noted.get("dropout_p", 0.0)),
    )
    backend = cuda_backend(call, capability, enabled=noted.get("sdp_enabled"))
    return _CUDA_ATTENTION_OPS.get(backend, _CPU_FLASH)


@contextmanager
def _policies_see_cuda_ops(tracker: Tracker, capability: tuple[int, int] | None) -> Iterator[None]:
    """A selective-checkpoint policy written for CUDA names CUDA's ops (``aten.
    _scaled_dot_product_flash_attention``, ``_efficient_``, ``_cudnn_``); the what-if runs the CPU's
    flash kernel, whose name no such policy lists, so attention it saves on CUDA would be recomputed
    (kept less than the CUDA run keeps). Inside, every policy torch's selective checkpointing builds
    (``_CachingTorchDispatchMode``, the one that asks it) is shown the op CUDA would run instead."""
    import torch.utils.checkpoint as checkpoint

    mode = getattr(checkpoint, "_CachingTorchDispatchMode", None)
    if mode is None:
        yield
        return
    original = mode.__init__

    def shown_cuda_ops(self: Any, policy_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        def policy(ctx: Any, func: Any, *op_args: Any, **op_kwargs: Any) -> Any:
            if func is _CPU_FLASH:
                func = _cuda_attention_op(op_args, op_kwargs, tracker.op_context, capability)
            return policy_fn(ctx, func, *op_args, **op_kwargs)

        original(self, policy, *args, **kwargs)

    mode.__init__ = shown_cuda_ops
    try:
        yield
    finally:
        mode.__init__ = original


@contextmanager
def _flex_attention_as_cuda() -> Iterator[None]:
    """``torch.nn.attention.flex_attention`` refuses inputs that require grad on the CPU only
    (``_validate_device``: "does not support backward on CPU"); on CUDA, eager, the same higher-order
    op runs its dense implementation forward and backward -- the one that runs here on the fake CPU
    tensors. Inside, the device check is CUDA's (none for CUDA); put back on exit."""
    module = sys.modules.get("torch.nn.attention.flex_attention")
    original = getattr(module, "_validate_device", None)
    if module is None or original is None:
        yield
        return
    setattr(module, "_validate_device", lambda query, key, value: None)  # noqa: B010
    try:
        yield
    finally:
        setattr(module, "_validate_device", original)  # noqa: B010
