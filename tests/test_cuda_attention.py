"""The SDPA backend-choice and saved-bytes model (``accounting/kernels/cuda_attention.py``), on
hand-derived cases.

Each case cites the filter of ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (or
``sdp_utils_cpp.h``) or the meta function of ``torch/_meta_registrations.py`` it comes from.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_memest.accounting.kernels.cuda_attention import (
    AttentionCall,
    cuda_backend,
    prefers_cudnn,
    saved_bytes,
)

# Compute capabilities: A100, A10 (sm86), L4 (sm89), T4, V100, H100, B200, RTX 5090 (sm120), P100.
A100, A10, L4, T4, V100 = (8, 0), (8, 6), (8, 9), (7, 5), (7, 0)
H100, B200, RTX5090, P100 = (9, 0), (10, 0), (12, 0), (6, 0)


def make(**kw: object) -> AttentionCall:
    base = AttentionCall(
        batch=2,
        heads=4,
        q_len=128,
        kv_len=128,
        head_dim=64,
        value_head_dim=64,
        dtype=torch.bfloat16,
        has_mask=False,
        dropout=False,
        is_causal=False,
        requires_grad=True,
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_bf16_on_a100_is_flash() -> None:
    # Context.h's default order starts with flash; every can_use_flash_attention filter passes.
    assert cuda_backend(make(), A100) == "flash"


def test_unknown_capability_assumes_a100() -> None:
    assert cuda_backend(make(), None) == cuda_backend(make(), A100) == "flash"
    assert cuda_backend(make(dtype=torch.float32), None) == "efficient"


def test_fp32_is_efficient() -> None:
    # check_dtypes_flash_attention: fp16/bf16 only; the mem-efficient kernel takes fp32 (sm >= 80 list).
    assert cuda_backend(make(dtype=torch.float32), A100) == "efficient"


def test_attn_mask_rules_out_flash() -> None:
    # check_for_attn_mask: "Flash Attention does not support non-null attn_mask"; efficient takes any mask.
    assert cuda_backend(make(has_mask=True), A100) == "efficient"


def test_causal_non_square_rules_out_flash() -> None:
    # check_flash_causal_non_square_seqlens.
    assert cuda_backend(make(is_causal=True, q_len=64, kv_len=128), A100) == "efficient"
    assert cuda_backend(make(is_causal=True), A100) == "flash"


def test_head_dim_256_training_on_sm86() -> None:
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: head_dim in (192, 224] with
    # grad, or > 224 with grad and dropout, is refused on sm86-89 / sm120-121. 256 without dropout passes.
    assert cuda_backend(make(head_dim=256, value_head_dim=256), A10) == "flash"
    assert cuda_backend(make(head_dim=256, value_head_dim=256, dropout=True), A10) == "efficient"
    assert cuda_backend(make(head_dim=208, value_head_dim=208), L4) == "efficient"
    assert cuda_backend(make(head_dim=208, value_head_dim=208), RTX5090) == "efficient"
    # Inference (no grad) and sm80 are not restricted.
    assert cuda_backend(make(head_dim=208, value_head_dim=208, requires_grad=False), A10) == "flash"
    assert cuda_backend(make(head_dim=208, value_head_dim=208), A100) == "flash"


def test_head_dim_limits() -> None:
    # check_head_dim_size_flash: q, k, v same last dim and <= 256.
    assert cuda_backend(make(head_dim=320, value_head_dim=320), A100) == "efficient"
    assert cuda_backend(make(head_dim=64, value_head_dim=128), A100) == "efficient"
    # Flash does not need 8-alignment (attention.cpp pads); efficient needs 8 for half on sm80.
    assert cuda_backend(make(head_dim=60, value_head_dim=60), A100) == "flash"
    assert cuda_backend(make(head_dim=60, value_head_dim=60, has_mask=True), A100) == "math"
    # minimum_gemm_alignment: 4 for fp32 on sm80, 1 for fp32 below sm80 (no tensor cores).
    assert cuda_backend(make(head_dim=60, value_head_dim=60, dtype=torch.float32), A100) == "efficient"
    assert cuda_backend(make(head_dim=62, value_head_dim=62, dtype=torch.float32), A100) == "math"
    assert cuda_backend(make(head_dim=62, value_head_dim=62, dtype=torch.float32), T4) == "efficient"


def test_older_gpus() -> None:
    # check_flash_attention_hardware_support: [sm80, sm121]; check_mem_efficient_hardware_support:
    # [sm50, sm121], with fp16/fp32 only below sm80.
    assert cuda_backend(make(dtype=torch.float16), T4) == "efficient"
    assert cuda_backend(make(dtype=torch.float16), V100) == "efficient"
    assert cuda_backend(make(dtype=torch.bfloat16), T4) == "math"
    assert cuda_backend(make(dtype=torch.float32), P100) == "efficient"
    assert cuda_backend(make(dtype=torch.float16), (3, 7)) == "math"


def test_cudnn_first_on_hopper_and_blackwell() -> None:
    # check_prefer_cudnn_attention: cuDNN > 9.15.0 and (major 9 or 10) with minor 0 or 3.
    assert prefers_cudnn(H100) and prefers_cudnn(B200) and prefers_cudnn((10, 3))
    assert not prefers_cudnn(A100) and not prefers_cudnn(RTX5090) and not prefers_cudnn(H100, 91500)
    assert cuda_backend(make(), H100) == "cudnn"
    assert cuda_backend(make(), B200) == "cudnn"
    assert cuda_backend(make(), H100, cudnn_version=91500) == "flash"  # old cuDNN: default order
    # cuDNN takes masks (check_attn_mask_shape), so it wins over efficient with one.
    assert cuda_backend(make(has_mask=True), H100) == "cudnn"
    # Not cuDNN: fp32 (check_dtypes_low_precision), dropout 0.1 (check_cudnn_dropout needs k/16),
    # head_dim not a multiple of 8 or above 128 off sm90 (check_cudnn_tensor_shapes), kv_len 1.
    assert cuda_backend(make(dtype=torch.float32), H100) == "efficient"
    assert cuda_backend(make(dropout=True), H100) == "flash"
    assert cuda_backend(make(dropout=True, dropout_p=0.125), H100) == "cudnn"
    assert cuda_backend(make(head_dim=60, value_head_dim=60), H100) == "flash"
    assert cuda_backend(make(head_dim=256, value_head_dim=256, requires_grad=False), H100) == "cudnn"
    assert cuda_backend(make(head_dim=256, value_head_dim=256, requires_grad=False), B200) == "flash"
    assert cuda_backend(make(kv_len=1, q_len=1), H100) == "flash"


def test_saved_bytes_flash() -> None:
    # meta__scaled_dot_product_flash_attention: logsumexp (B, H, L) fp32; rng_state uint64[2] and a
    # uint64 scalar on the GPU.
    call = make(q_len=100, kv_len=300)
    assert saved_bytes(call, "flash") == 2 * 4 * 100 * 4 + 16 + 8
    # head_dim 60 -> pad_last_dim<8> makes 64-wide q, k, v copies, and the output is 64 wide.
    padded = make(q_len=100, kv_len=300, head_dim=60, value_head_dim=60)
    extra = (2 * 4 * 100 * 64 + 2 * 2 * 4 * 300 * 64) * 2 + 2 * 4 * 100 * 4 * 2
    assert saved_bytes(padded, "flash") == 2 * 4 * 100 * 4 + 24 + extra


def test_saved_bytes_efficient_pads_logsumexp() -> None:
    # meta__scaled_dot_product_efficient_attention: logsumexp (B, H, ceil(M / 32) * 32) when
    # compute_log_sumexp; q_len 100 -> 128 columns. Seed/offset are CPU tensors outside graph capture.
    assert saved_bytes(make(q_len=100), "efficient") == 2 * 4 * 128 * 4
    assert saved_bytes(make(q_len=128), "efficient") == 2 * 4 * 128 * 4
    assert saved_bytes(make(q_len=100, requires_grad=False), "efficient") == 0


def test_saved_bytes_cudnn() -> None:
    # meta__scaled_dot_product_cudnn_attention: logsumexp (B, H, L, 1) fp32; int64 seed and offset.
    assert saved_bytes(make(q_len=100), "cudnn") == 2 * 4 * 100 * 4 + 16


def test_saved_bytes_math_known_shape() -> None:
    # _scaled_dot_product_attention_math: bf16 upcast to fp32; saved are q*s (B,H,L,E), k^T*s (B,H,S,E),
    # the softmax (B,H,L,S) and the fp32 copy of v (B,H,S,Ev).
    call = make(batch=1, heads=2, q_len=10, kv_len=20, head_dim=8, value_head_dim=8)
    expected = (1 * 2 * 10 * 8 + 1 * 2 * 20 * 8 + 1 * 2 * 10 * 20 + 1 * 2 * 20 * 8) * 4
    assert saved_bytes(call, "math") == expected == 4800
    # fp32: no copies of v; dropout adds native_dropout's bool mask and the fp32 dropped weights.
    fp32 = dataclasses.replace(call, dtype=torch.float32)
    assert saved_bytes(fp32, "math") == (160 + 320 + 400) * 4
    assert saved_bytes(dataclasses.replace(fp32, dropout=True), "math") == (160 + 320 + 400) * 4 + 400 * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_math_matches_the_decomposition_on_cpu(dtype: torch.dtype, is_causal: bool) -> None:
    # The math backend is a composite op, the same on CPU and CUDA (without dropout, whose CPU path
    # differs): count the distinct storages autograd saves, less q, k, v.
    b, h, lq, lk, e = 2, 3, 5, 7, 8
    if is_causal:
        lk = lq
    q = torch.randn(b, h, lq, e, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h, lk, e, dtype=dtype, requires_grad=True)
    v = torch.randn(b, h, lk, e, dtype=dtype, requires_grad=True)
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in inputs:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, is_causal)
    call = AttentionCall(
        batch=b,
        heads=h,
        q_len=lq,
        kv_len=lk,
        head_dim=e,
        value_head_dim=e,
        dtype=dtype,
        has_mask=False,
        dropout=False,
        is_causal=is_causal,
        requires_grad=True,
    )
    assert saved_bytes(call, "math") == sum(storages.values())


def test_no_grad_saves_nothing_and_unknown_backend_raises() -> None:
    for backend in ("flash", "efficient", "cudnn", "math"):
        assert saved_bytes(make(requires_grad=False), backend) == 0
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        saved_bytes(make(), "fa3")
