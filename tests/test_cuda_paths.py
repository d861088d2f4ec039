"""CUDA's code paths in a CUDA what-if (``engine.cuda_paths``): what the what-if saves for backward equals
what the CUDA dispatch saves, read from autograd's graph on fake CUDA tensors (their forward runs on a
machine without a GPU; no GPU needed), for dropout, batch norm, embedding, cross-entropy and attention;
and the SDP backend follows the user's flags."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_memest import estimate_step
from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.engine import cuda_paths
from lightning_memest.engine.cuda_paths import cuda_code_paths
from lightning_memest.engine.tracker import Tracker


def _saved(out: Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of every tensor autograd saved in ``out``'s graph."""
    found, seen, todo = [], set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_"):
                value = getattr(fn, name)
                if isinstance(value, Tensor):
                    found.append((value.dtype, tuple(value.shape)))
        todo += [f for f, _ in fn.next_functions]
    return sorted(found, key=str)


def _dropout(dev: str) -> Tensor:
    return F.dropout(torch.empty(4, 8, 16, device=dev, requires_grad=True), 0.1, training=True)


def _module_dropout(dev: str) -> Tensor:
    return nn.Dropout(0.25)(torch.empty(6, 10, device=dev, dtype=torch.bfloat16, requires_grad=True))


def _batch_norm(dev: str) -> Tensor:
    x = torch.empty(4, 8, 6, 6, device=dev, requires_grad=True)
    w, b = (torch.empty(8, device=dev, requires_grad=True) for _ in range(2))
    return F.batch_norm(x, torch.zeros(8, device=dev), torch.ones(8, device=dev), w, b, training=True)


def _embedding(dev: str) -> Tensor:
    return F.embedding(
        torch.zeros(4, 8, dtype=torch.long, device=dev), torch.empty(100, 16, device=dev, requires_grad=True)
    )


def _cross_entropy(dev: str) -> Tensor:
    logits = torch.empty(32, 100, device=dev, requires_grad=True)
    return F.cross_entropy(logits, torch.zeros(32, dtype=torch.long, device=dev))


@pytest.mark.parametrize(
    "op", [_dropout, _module_dropout, _batch_norm, _embedding, _cross_entropy], ids=lambda f: f.__name__[1:]
)
def test_the_what_if_saves_what_the_cuda_dispatch_saves(op: Callable[[str], Tensor]) -> None:
    with FakeTensorMode():
        cuda = [s for s in _saved(op("cuda")) if s[1] != (0,)]  # (cuDNN batch norm's empty reserve)
        with cuda_code_paths(Tracker()):
            what_if = _saved(op("cpu"))
    assert what_if == cuda


def test_in_place_and_evaluation_dropout_take_the_plain_path() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with cuda_code_paths(Tracker()):
        assert F.dropout(x, 0.1, training=False) is x
        y = F.dropout(x.clone(), 0.1, training=True, inplace=True)
    assert type(y.grad_fn).__name__ != "NativeDropoutBackward0"


class Attention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)


@contextmanager
def _flags(**enabled: bool) -> Iterator[None]:
    setters = {
        "flash": torch.backends.cuda.enable_flash_sdp,
        "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
        "cudnn": torch.backends.cuda.enable_cudnn_sdp,
    }
    before = cuda_paths.sdp_enabled()
    for name, on in enabled.items():
        setters[name](on)
    try:
        yield
    finally:
        for name, setter in setters.items():
            setter(name in before)


def test_the_sdp_backend_follows_the_users_flags() -> None:
    # 4 x 512 tokens, 4 heads, float32 on an A100: the memory-efficient kernel (flash takes only half
    # precision) saves a logsumexp; with it turned off -- by the flag or by sdpa_kernel inside the step --
    # CUDA runs math, whose saved T x T softmax the what-if counts; the CPU's own choice plays no part.
    model, x = Attention(), torch.randn(4, 512, 64)
    gpu = CudaDevice((8, 0))

    def peak(step: Callable[[nn.Module, Any], Tensor] = lambda m, b: m(b).sum()) -> int:
        return estimate_step(model, x, loss_fn=step, device="cuda", gpu=gpu, steps=1).peak_bytes

    efficient = peak()
    with _flags(flash=False):  # the CPU would take math here; CUDA still has the efficient kernel
        assert peak() == efficient
    with _flags(efficient=False):
        math = peak()

    def in_block(m: nn.Module, b: Tensor) -> Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return m(b).sum()

    assert peak(in_block) == math
    softmax = 4 * 4 * 512 * 512 * 4  # (B, H, L, L) float32
    assert math - efficient >= softmax, (math, efficient)
    assert efficient < softmax


def test_gpt2_dropout_masks_are_bool_in_a_cuda_what_if(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers' GPT-2 with dropout 0.1 in embeddings, attention weights (eager) and residuals: on
    # CUDA each Dropout saves a bool mask, on the CPU a float one; the what-if's activations fall by 3/4
    # of the float masks.
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (2, 128))

    def loss(m: nn.Module, b: Tensor) -> Tensor:
        return m(input_ids=b, labels=b).loss  # type: ignore[no-any-return]

    def saved() -> dict[str, int]:
        est = estimate_step(model, ids, loss_fn=loss, device="cuda", steps=1)
        return {m.path: m.saved_bytes for m in est.modules.walk()}

    cuda = saved()
    monkeypatch.setattr(cuda_paths, "CUDA_PATHS", {})
    cpu = saved()
    b, s, d, h = 2, 128, 64, 4
    masks = {"transformer.drop": b * s * d}
    for layer in range(2):
        masks[f"transformer.h.{layer}.attn.resid_dropout"] = b * s * d
        masks[f"transformer.h.{layer}.mlp.dropout"] = b * s * d
    for path, n in masks.items():
        assert (cuda[path], cpu[path]) == (n, 4 * n), path  # bool against float32 masks
    # eager attention drops its weights with F.dropout (counted in the attention module)
    weights = 2 * b * h * s * s
    assert cpu[""] - cuda[""] == 3 * (sum(masks.values()) + weights)


class FlexBlock(nn.Module):
    """Causal self-attention through ``flex_attention`` (eager: its dense composite), or none."""

    def __init__(self, flex: bool, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.o, self.heads, self.flex = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, flex

    def forward(self, x: Tensor) -> Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)

        def causal(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            return torch.where(qi >= ki, score, -float("inf"))

        y = flex_attention(q, k, v, score_mod=causal) if self.flex else q * k + v
        out: Tensor = self.o(y.transpose(1, 2).reshape(b, t, d))  # type: ignore[union-attr]
        return out


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_flex_attention_in_a_cuda_what_if_allocates_what_its_dense_eager_run_allocates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the CPU flex_attention refuses inputs that require grad; eager on CUDA it runs the same dense
    # composite forward and backward. Measured here by the profiler with the CPU's refusal lifted, and
    # compared as what attention adds to the same block without it (the what-if's CUDA-only memory,
    # cuBLAS's workspace, cancels).
    import torch.nn.attention.flex_attention as flex_module

    from lightning_memest.engine.step import StepConfig
    from lightning_memest.measure import measure_step

    x = torch.randn(2, 256, 64)
    config = StepConfig(loss_fn=lambda m, b: m(b).sum())
    what_if = {
        f: estimate_step(FlexBlock(f), x, loss_fn=config.loss_fn, device="cuda") for f in (True, False)
    }
    with monkeypatch.context() as patched:
        patched.setattr(flex_module, "_validate_device", lambda query, key, value: None)
        real = {f: measure_step(FlexBlock(f), x, config) for f in (True, False)}
    added = what_if[True].first_step.bytes - what_if[False].first_step.bytes
    measured = real[True].first_step - real[False].first_step
    assert measured > 1 << 20  # the scores, materialised
    assert measured <= added <= 1.05 * measured, (added, measured)  # CUDA's 512-byte blocks at most


class CheckpointedAttention(nn.Module):
    """Self-attention under torch's selective checkpointing with the given policy."""

    def __init__(self, policy: Callable[..., Any], d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.o, self.heads, self.policy = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, policy

    def attend(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (y.transpose(1, 2).reshape(b, t, d) * 2).relu()

    def forward(self, x: Tensor) -> Tensor:
        from functools import partial

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        contexts = partial(create_selective_checkpoint_contexts, self.policy)
        out: Tensor = self.o(checkpoint(self.attend, x, use_reentrant=False, context_fn=contexts))
        return out


def _saving(ops: set[Any], seen: list[Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        seen.append(op)
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.mark.parametrize(
    ("capability", "dtype", "picked"),
    [
        ((8, 0), torch.float32, "efficient"),
        ((8, 0), torch.bfloat16, "flash"),
        ((9, 0), torch.bfloat16, "cudnn"),
    ],
)
def test_a_checkpoint_policy_written_for_cuda_sees_cudas_attention_op_in_a_what_if(
    capability: tuple[int, int], dtype: torch.dtype, picked: str
) -> None:
    # A policy that saves CUDA's attention outputs (as torchtitan's does) saw the CPU kernel's name in a
    # what-if and recomputed attention: the estimate kept less than the CUDA run keeps.
    aten = torch.ops.aten
    cuda_ops = {
        "flash": aten._scaled_dot_product_flash_attention.default,
        "efficient": aten._scaled_dot_product_efficient_attention.default,
        "cudnn": aten._scaled_dot_product_cudnn_attention.default,
    }
    cpu_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    x = torch.randn(2, 256, 64)
    gpu = CudaDevice(capability=capability)

    def kept(policy: Callable[..., Any]) -> int:
        model = CheckpointedAttention(policy).to(dtype)
        est = estimate_step(model, x.to(dtype), loss_fn=lambda m, b: m(b).sum(), device="cuda", gpu=gpu)
        # what the forward leaves for backward (its end), where a saved attention output shows
        return next(m.live_bytes for m in est.phase_marks if m.step == 1 and m.phase.name == "FORWARD")

    seen: list[Any] = []
    with_cuda_names = kept(_saving(set(cuda_ops.values()), seen))
    assert cuda_ops[picked] in seen and cpu_op not in seen, seen
    recomputed = kept(_saving(set(), []))
    assert kept(_saving({cpu_op}, [])) == recomputed  # the CPU's name is never shown: CUDA never runs it
    output = 2 * 256 * 64 * dtype.itemsize  # (B, H, T, D/H): saved, not recomputed, from forward's end on
    assert with_cuda_names - recomputed >= output, (with_cuda_names, recomputed)
    # A policy naming another backend's op alone recomputes, as the GPU that picks this one would.
    others = {op for name, op in cuda_ops.items() if name != picked}
    assert kept(_saving(others, [])) == recomputed
