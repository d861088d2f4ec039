"""CUDA attention: which kernel ``F.scaled_dot_product_attention`` runs, and what it keeps for backward.

A CPU run never goes through the CUDA dispatcher of SDPA, so a "CUDA what-if" has to predict it: this
module registers :func:`cuda_what_if_memory` for the CPU attention op among the CUDA what-if kernel
models (``kernels/model.py``). It is a pure model of that choice in PyTorch 2.14 (the release this
project measures against) and of the bytes each backend's forward leaves saved for backward.

Backend choice (:func:`cuda_backend`, the CUDA dispatcher's, in ``engine.cuda_sdp_choice``: the
what-if's checkpoint policies are shown the op it picks) follows ``select_sdp_backend``.

Saved bytes (:func:`saved_bytes`) count what the forward allocates *beyond its output* that autograd
keeps until backward: q, k, v and the output are not counted (the caller has them; fused backends save
the output, math saves no output). From the meta functions in ``torch/_meta_registrations.py`` and the
CUDA implementations (``attention.cu``, ``flash_api.cpp``):

* flash (``meta__scaled_dot_product_flash_attention``): logsumexp ``(B, H, L)`` fp32, plus a 2-element
  uint64 ``rng_state`` and a uint64 scalar, both on the GPU ("[Note] BC breaking change to flash
  seed/offset"); when the head dim is not a multiple of 8, the padded copies of q, k, v that
  ``attention.cpp`` makes (``pad_last_dim<8>``) and the output's padding are saved too.
* efficient (``meta__scaled_dot_product_efficient_attention``): logsumexp ``(B, H, ceil(L / 32) * 32)``
  fp32 when ``compute_log_sumexp`` (inputs need grad); seed and offset are CPU tensors outside CUDA graph
  capture ("Note [Seed and Offset Device]"), so they cost the GPU nothing.
* cudnn (``meta__scaled_dot_product_cudnn_attention``): logsumexp ``(B, H, L, 1)`` fp32, plus int64
  seed and offset scalars on the GPU (``_cudnn_attention_forward``).
* math (``_scaled_dot_product_attention_math`` in ``attention.cpp``): fp16/bf16 inputs are upcast to
  fp32 (``allow_fp16_bf16_reduction_mathSDP`` defaults to false); the scaled query ``(B, H, L, E)``, the
  scaled key ``(B, H, S, E)`` and the softmax ``(B, H, L, S)`` are saved in the compute dtype, so is the
  fp32 copy of a half value; with dropout, CUDA's ``native_dropout`` adds its bool mask and the dropped
  weights ``(B, H, L, S)``.

An ``attn_mask`` is not counted: its shape is unknown here (efficient saves the mask, padded to a
multiple of 16 when misaligned; a bool mask becomes a float copy). Without grad nothing is saved.

Example:
    >>> import torch
    >>> call = AttentionCall(batch=8, heads=16, q_len=1000, kv_len=1000, head_dim=64, value_head_dim=64,
    ...                      dtype=torch.bfloat16, has_mask=False, dropout=False, is_causal=True,
    ...                      requires_grad=True)
    >>> saved_bytes(call, "flash")        # logsumexp 8*16*1000*4, rng state 16 + 8
    512024
    >>> saved_bytes(call, "efficient")    # logsumexp padded to 1024 columns
    524288
"""

from __future__ import annotations

import torch

from lightning_memest.accounting.kernels.model import CUDA_WHAT_IF_KERNELS, Capability, KernelMemory
from lightning_memest.engine.cuda_sdp_choice import (
    ASSUMED_CAPABILITY,
    BACKENDS,
    DEFAULT_CUDNN_VERSION,
    DEFAULT_DROPOUT_P,
    AttentionCall,
    cuda_backend,
    prefers_cudnn,
)
from lightning_memest.engine.events import OpCall

__all__ = [
    "ASSUMED_CAPABILITY",
    "BACKENDS",
    "CPU_ATTENTION",
    "DEFAULT_CUDNN_VERSION",
    "DEFAULT_DROPOUT_P",
    "AttentionCall",
    "cuda_backend",
    "cuda_what_if_memory",
    "prefers_cudnn",
    "saved_bytes",
]

_HALF = (torch.float16, torch.bfloat16)
_LSE_ITEMSIZE = 4  # logsumexp is float32 for every fused backend


def saved_bytes(call: AttentionCall, backend: str) -> int:
    """GPU bytes the forward of ``backend`` leaves saved for backward beyond its output and q, k, v.

    Zero when ``call.requires_grad`` is false (nothing is recorded, the extras die with the op). The
    sizes are raw tensor bytes, before the caching allocator rounds each block (to 512 B at least).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}; expected one of {BACKENDS}")
    if not call.requires_grad:
        return 0
    b, h, lq, lk = call.batch, call.heads, call.q_len, call.kv_len
    d, dv = call.head_dim, call.value_head_dim
    item = call.dtype.itemsize
    if backend == "flash":
        total = b * h * lq * _LSE_ITEMSIZE + 2 * 8 + 8  # logsumexp; rng_state uint64[2]; unused uint64[]
        padded = -(-d // 8) * 8
        if padded != d:  # pad_last_dim<8>: new q, k, v are saved, and the output is allocated padded
            total += (b * h * lq * padded + 2 * b * h * lk * padded) * item + b * h * lq * (padded - d) * item
        return total
    if backend == "efficient":
        return b * h * (-(-lq // 32) * 32) * _LSE_ITEMSIZE  # seed/offset live on the CPU
    if backend == "cudnn":
        return b * h * lq * 1 * _LSE_ITEMSIZE + 8 + 8  # logsumexp (B, H, L, 1); int64 seed and offset
    # math: the decomposition computes in fp32 for half inputs.
    acc = 4 if call.dtype in _HALF else item
    total = (b * h * lq * d + b * h * lk * d + b * h * lq * lk) * acc  # scaled q, scaled k, softmax
    if call.dtype in _HALF:
        total += b * h * lk * dv * 4  # the fp32 copy of v that the second matmul saves
    if call.effective_dropout_p > 0.0:
        total += b * h * lq * lk * (1 + acc)  # native_dropout's bool mask and the dropped weights
    return total


#: The op a CPU run of ``scaled_dot_product_attention`` calls (when the CPU picks its flash kernel).
CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


@CUDA_WHAT_IF_KERNELS.register(CPU_ATTENTION)
def cuda_what_if_memory(call: OpCall, capability: Capability) -> KernelMemory | None:
    """In a CUDA what-if (the step ran on the CPU), what the CUDA backend would save beyond what the CPU
    kernel saved: the CPU kernel keeps a ``(B, H, L)`` fp32 logsumexp; the difference is put on that
    output. Inputs are taken to need grad (a training step).

    >>> import torch
    >>> from lightning_memest.engine.events import OpCall, TensorMeta
    >>> q = TensorMeta((2, 4, 100, 64), (25600, 6400, 64, 1), torch.float32, "cpu", 204800)
    >>> lse = TensorMeta((2, 4, 100), (400, 100, 1), torch.float32, "cpu", 3200)
    >>> call = OpCall(CPU_ATTENTION, (q, q, q), {}, (q, lse), "cpu")
    >>> cuda_what_if_memory(call, (8, 0))  # fp32 on an A100: efficient, logsumexp padded to 128
    KernelMemory(workspace_bytes=0, workspace_after_outputs=True, extra_output_bytes=(0, 896))
    """
    if call.op != CPU_ATTENTION:
        return None
    q, k, v = call.args[:3]
    # (the what-if's CPU kernel ran without dropout: its probability and the flags are in the context)
    dropout_p = float(call.noted("dropout_p", call.arg("dropout_p", 0.0)))
    attention = AttentionCall.of(
        q, k, v, has_mask=call.arg("attn_mask") is not None, is_causal=bool(call.arg("is_causal", False)),
        dropout_p=dropout_p,
    )  # fmt: skip
    cpu_saved = attention.batch * attention.heads * attention.q_len * _LSE_ITEMSIZE
    backend = cuda_backend(attention, capability, enabled=call.noted("sdp_enabled"))
    extra = saved_bytes(attention, backend) - cpu_saved
    return KernelMemory(extra_output_bytes=(0, extra)) if extra > 0 else None
