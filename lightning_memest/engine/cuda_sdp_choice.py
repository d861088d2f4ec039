"""Which kernel CUDA's ``F.scaled_dot_product_attention`` dispatches to: the CUDA dispatcher's choice,
for a what-if that runs on the CPU (its checkpoint policies are shown the op CUDA runs,
``engine.cuda_paths``; the accounting counts what that kernel saves, ``accounting.kernels.cuda_attention``).

Backend choice (:func:`cuda_backend`) follows ``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, with the shared filters of
``aten/src/ATen/native/transformers/sdp_utils_cpp.h``:

* Priority. ``Context.h`` (installed header ``torch/include/ATen/Context.h``) sets the default
  ``sdp_priority_order = {flash_attention, efficient_attention, math, cudnn_attention, overrideable}``
  and every ``enabled_*SDP`` flag, cuDNN's included, to ``true`` (``enabled_fa3SDP`` is ``false``). So
  cuDNN is enabled but sits behind math, which always succeeds: it is never picked, except where
  ``priority_order`` replaces the order, at its first call, with ``{cudnn, flash, efficient, math}``. It
  does so when ``check_prefer_cudnn_attention()`` holds: ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` unset, the
  runtime cuDNN newer than 9.15.0 (``cudnn_version > 91500``, the seq_len fix of pytorch#169849), and
  compute capability 9.0, 10.0 or 10.3 (``(major == 9 || major == 10) && (!minor || minor == 3)``).
  The torch 2.14.1+cu130 wheel ships cuDNN 9.24.0, so H100/H200 and B200/B300 pick cuDNN first.
* ``can_use_flash_attention``: no ``attn_mask`` (``check_for_attn_mask``); q, k, v with the same head
  dim, at most 256 (``check_head_dim_size_flash``; ``attention.cpp`` pads it to a multiple of 8);
  sm80 to sm121 (``check_flash_attention_hardware_support``); with grad on sm86-89 and sm120-121 no head
  dim in (192, 224], nor above 224 with dropout
  (``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``); ``is_causal`` only with
  ``q_len == kv_len`` (``check_flash_causal_non_square_seqlens``); fp16 or bf16
  (``check_dtypes_flash_attention``, FA3's fp8 is off by default).
* ``can_use_mem_efficient_attention``: sm50 to sm121; head dims divisible by ``minimum_gemm_alignment``
  (8 for fp16/bf16 from sm70; 4 for fp32 from sm80; 1 for fp32 below sm80), q and k head dims equal;
  fp16, fp32 and (from sm80) bf16. Any ``attn_mask`` and any head dim size are fine.
* ``can_use_cudnn_attention``: fp16 or bf16, sm80 to sm121, no dropout on cuDNN 9.11-9.13, a dropout
  probability that is a multiple of 1/16 (``check_cudnn_dropout``), and ``check_cudnn_tensor_shapes``:
  batch and heads at most 65535, head dims multiples of 8 and at most 128 (256 on sm90 from cuDNN 9.10;
  (192, 128) on sm10x from cuDNN 9.11), ``kv_len != 1``, no ``q_len == 1`` with dropout. Two filters of
  the 2.14 binary are known only from their warning strings in ``libtorch_cuda.so`` (no source copy with
  them was found): "cuDNN SDPA decode is disabled ... for cuDNN versions 9.19-9.25.0 (except 9.24.1) on
  SM 10.x and 11.x", modelled as ``q_len == 1`` on those GPUs; and ``check_cudnn_d256_bprop_head_dim``,
  "cuDNN SDPA on SM 9.0/10.x does not support backward with these head dimensions", modelled as: no
  training with a head dim above 128 on sm90/sm10x (a guess at the exact range; the backends it then
  falls to keep the same bytes within 24).
* math: always enabled, so the last resort.

Not modelled (the defaults and common cases are assumed): nested tensors, GQA (``enable_gqa``),
``use_deterministic_algorithms`` (which vetoes cuDNN), strides and storage offsets (all are taken as
contiguous and aligned; the cuDNN layout check is not in ``can_use_cudnn_attention``'s list),
``attn_mask`` shapes (taken as 2-D or 4-D broadcastable, without grad), user changes to the order
(``torch._C._set_sdp_priority_order``), and ROCm. The enable flags are followed
(``cuda_backend(enabled=...)``): in a what-if, ``engine.cuda_paths`` records them at each call.

Example:
    >>> import torch
    >>> call = AttentionCall(batch=8, heads=16, q_len=1000, kv_len=1000, head_dim=64, value_head_dim=64,
    ...                      dtype=torch.bfloat16, has_mask=False, dropout=False, is_causal=True,
    ...                      requires_grad=True)
    >>> cuda_backend(call, (8, 0)), cuda_backend(call, (9, 0)), cuda_backend(call, (7, 5))
    ('flash', 'cudnn', 'math')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ASSUMED_CAPABILITY",
    "BACKENDS",
    "DEFAULT_CUDNN_VERSION",
    "DEFAULT_DROPOUT_P",
    "AttentionCall",
    "cuda_backend",
    "prefers_cudnn",
]

BACKENDS: tuple[str, ...] = ("flash", "efficient", "cudnn", "math")
# What ``capability=None`` stands for: an A100.
ASSUMED_CAPABILITY: tuple[int, int] = (8, 0)
# ``torch.backends.cudnn.version()`` of the torch 2.14.1+cu130 wheel (nvidia-cudnn-cu13 9.24.0).
DEFAULT_CUDNN_VERSION = 92400
# ``nn.MultiheadAttention``/``nn.Transformer*``'s default, used when only "dropout on" is known.
DEFAULT_DROPOUT_P = 0.1

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionCall:
    """One SDPA call in the layout ``(batch, heads, seq, head_dim)``, q, k and v with the same heads.

    ``requires_grad`` means autograd records the call (some input needs grad and grad mode is on, as
    ``input_requires_grad`` reads it). ``dropout_p`` refines ``dropout`` where the probability is known;
    cuDNN only takes multiples of 1/16, and with ``None`` :data:`DEFAULT_DROPOUT_P` is assumed.
    """

    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_head_dim: int
    dtype: torch.dtype
    has_mask: bool
    dropout: bool
    is_causal: bool
    requires_grad: bool
    dropout_p: float | None = None

    @classmethod
    def of(
        cls, q: Any, k: Any, v: Any, *, has_mask: bool, is_causal: bool, dropout_p: float
    ) -> AttentionCall:
        """The call of a training step (inputs that need grad) on q, k, v of layout (batch, heads,
        seq, head_dim) -- tensors, or anything with their ``shape`` and ``dtype``."""
        return cls(
            batch=q.shape[0],
            heads=q.shape[1],
            q_len=q.shape[2],
            kv_len=k.shape[2],
            head_dim=q.shape[3],
            value_head_dim=v.shape[3],
            dtype=q.dtype,
            has_mask=has_mask,
            dropout=dropout_p > 0.0,
            is_causal=is_causal,
            requires_grad=True,
            dropout_p=dropout_p,
        )

    @property
    def effective_dropout_p(self) -> float:
        if not self.dropout:
            return 0.0
        return DEFAULT_DROPOUT_P if self.dropout_p is None else self.dropout_p


def _in_sm_range(cap: tuple[int, int], lower: tuple[int, int], upper: tuple[int, int]) -> bool:
    # check_sm_version: inclusive on both ends, (major, minor) compared lexicographically.
    return lower <= cap <= upper


def prefers_cudnn(capability: tuple[int, int], cudnn_version: int = DEFAULT_CUDNN_VERSION) -> bool:
    """``check_prefer_cudnn_attention``: does ``priority_order`` put cuDNN first on this GPU?"""
    major, minor = capability
    return cudnn_version > 91500 and major in (9, 10) and minor in (0, 3)


def _can_use_flash(call: AttentionCall, cap: tuple[int, int]) -> bool:
    if call.has_mask:  # check_for_attn_mask
        return False
    # check_head_dim_size_flash: same last dim for q, k, v and <= 256 (not 8-aligned: attention.cpp pads).
    if call.head_dim != call.value_head_dim or not 0 < call.head_dim <= 256:
        return False
    if not _in_sm_range(cap, (8, 0), (12, 1)):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: FA2's backward lacks these.
    if call.requires_grad and (_in_sm_range(cap, (8, 6), (8, 9)) or _in_sm_range(cap, (12, 0), (12, 1))):
        d = call.head_dim
        if 192 < d <= 224 or (d > 224 and call.effective_dropout_p > 0.0):
            return False
    if call.is_causal and call.q_len != call.kv_len:  # check_flash_causal_non_square_seqlens
        return False
    if call.dtype not in _HALF:  # check_dtypes_flash_attention (sm >= 8 here)
        return False
    return call.q_len > 0 and call.kv_len > 0  # check_nonzero_sequence_lengths_dense


def _mem_efficient_alignment(call: AttentionCall, cap: tuple[int, int]) -> int:
    # minimum_gemm_alignment: 128-bit tensor-core loads from sm80 (always) or sm70 (half only).
    is_half = call.dtype in _HALF
    use_tc = cap[0] >= 8 or (cap[0] >= 7 and is_half)
    alignment = 4 if cap[0] >= 8 else 1
    if use_tc:
        alignment = max(alignment, 128 // (16 if is_half else 32))
    return alignment


def _can_use_efficient(call: AttentionCall, cap: tuple[int, int]) -> bool:
    if not _in_sm_range(cap, (5, 0), (12, 1)):  # check_mem_efficient_hardware_support
        return False
    a = _mem_efficient_alignment(call, cap)  # check_head_dim_size_mem_efficient
    if not all(dim > 0 and dim % a == 0 for dim in (call.head_dim, call.value_head_dim)):
        return False
    if call.q_len <= 0 or call.kv_len <= 0:  # check_nonzero_sequence_lengths_dense
        return False
    if cap[0] >= 8:
        return call.dtype in (torch.float16, torch.float32, torch.bfloat16)
    return call.dtype in (torch.float16, torch.float32)


def _can_use_cudnn(call: AttentionCall, cap: tuple[int, int], version: int) -> bool:
    p = call.effective_dropout_p
    if p > 0.0 and 91100 < version < 91400:  # "cuDNN version does not support dropout (9.11 - 9.13)"
        return False
    if p * 16.0 != float(int(p * 16.0)):  # check_cudnn_dropout: dropout resolution is 1/16
        return False
    if call.dtype not in _HALF:  # check_dtypes_low_precision (sm >= 8 here)
        return False
    if not _in_sm_range(cap, (8, 0), (12, 1)):  # check_cudnn_hardware_support
        return False
    if call.q_len <= 0 or call.kv_len <= 0:  # check_nonzero_sequence_lengths_dense
        return False
    # check_cudnn_tensor_shapes
    if call.batch > 65535 or call.heads > 65535:
        return False
    d_qk, d_v = call.head_dim, call.value_head_dim
    limit = 128
    if version >= 91000 and cap == (9, 0):
        limit = 256
    if version >= 91100 and cap[0] == 10 and (d_qk, d_v) == (192, 128):
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if call.kv_len == 1 or (call.q_len == 1 and p > 0.0):
        return False
    # 2.14 binary only (warning strings): decode disabled on sm10x/11x for cuDNN 9.19-9.25.0 but 9.24.1.
    if call.q_len == 1 and cap[0] in (10, 11) and 91900 <= version <= 92500 and version != 92401:
        return False
    # 2.14 binary only: check_cudnn_d256_bprop_head_dim; the exact head-dim range is an assumption.
    return not (call.requires_grad and (cap == (9, 0) or cap[0] == 10) and max(d_qk, d_v) > 128)


def cuda_backend(
    call: AttentionCall,
    capability: tuple[int, int] | None,
    *,
    cudnn_version: int = DEFAULT_CUDNN_VERSION,
    enabled: frozenset[str] | None = None,
) -> str:
    """The backend ``select_sdp_backend`` picks in the default order, among the ``enabled`` backends
    (the user's flags, ``engine.cuda_paths.sdp_enabled()``; ``None``: all, the defaults).

    Returns ``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"`` (math too where the flags leave
    nothing that can run, where CUDA raises "No available kernel").

    ``capability`` is the GPU's ``(major, minor)`` compute capability; ``None`` (unknown) assumes sm80, an
    A100 (:data:`ASSUMED_CAPABILITY`). ``cudnn_version`` is the runtime cuDNN as
    ``torch.backends.cudnn.version()`` reports it (9.24.0 is ``92400``).

    >>> call = AttentionCall(batch=4, heads=4, q_len=512, kv_len=512, head_dim=64, value_head_dim=64,
    ...                      dtype=torch.float32, has_mask=False, dropout=False, is_causal=True,
    ...                      requires_grad=True)
    >>> cuda_backend(call, (8, 0)), cuda_backend(call, (8, 0), enabled=frozenset({"flash", "math"}))
    ('efficient', 'math')
    """
    allowed = BACKENDS if enabled is None else enabled
    cap = ASSUMED_CAPABILITY if capability is None else capability
    if prefers_cudnn(cap, cudnn_version):
        order: tuple[str, ...] = ("cudnn", "flash", "efficient", "math")
    else:
        order = ("flash", "efficient", "math", "cudnn")  # Context.h's default sdp_priority_order
    for backend in order:
        if backend not in allowed:
            continue
        if backend == "math":
            return "math"  # userEnabledMathSDP() is true by default
        if backend == "flash" and _can_use_flash(call, cap):
            return "flash"
        if backend == "efficient" and _can_use_efficient(call, cap):
            return "efficient"
        if backend == "cudnn" and _can_use_cudnn(call, cap, cudnn_version):
            return "cudnn"
    return "math"
