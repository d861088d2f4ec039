"""FLOP counting (accounting/flops.py): formulas on hand-computed shapes, and whole fake runs against
published figures (torchvision's ``meta["_ops"]``), the 2·N·tokens rule and torch's own counter where it
is right."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import LSTMLanguageModel, TinyGPT, classification_loss, lm_batch, lm_loss
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_memest.accounting.flops import (
    FlopCount,
    captures_flops,
    count_flops,
    flop_formula_for,
    other_flop_formula_for,
)
from lightning_memest.engine.events import OpCall, OpEvent, Phase, TensorMeta
from lightning_memest.engine.simulate import simulate
from lightning_memest.engine.step import StepConfig

aten = torch.ops.aten


def meta(*shape: int) -> TensorMeta:
    return TensorMeta.of(torch.empty(shape))


def flops_of(op: torch._ops.OpOverload, *args: Any, outputs: tuple[TensorMeta | None, ...] = ()) -> int:
    formula = flop_formula_for(op)
    assert formula is not None
    return formula(OpCall(op, args, {}, outputs, "cpu"))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def fake_flops(model: nn.Module, batch: Any, loss: Any, *, steps: int = 1, optimizer: Any = sgd) -> FlopCount:
    sim = simulate(model, batch, StepConfig(loss, optimizer), steps=steps, capture=captures_flops)
    return count_flops(sim.events)


# ------------------------------------------------------------------------------ formulas, by hand


def _conv_backward_call(x: TensorMeta, w: TensorMeta, go: TensorMeta, groups: int, mask: list[bool]) -> int:
    args = (go, x, w, [w.shape[0]], [1, 1], [1, 1], [1, 1], False, [0, 0], groups, mask)
    return flops_of(aten.convolution_backward.default, *args)


def test_depthwise_convolution_backward_counts_groups() -> None:
    # x (2, 32, 16, 16), 3x3 depthwise (w (32, 1, 3, 3), groups 32), padding 1: output (2, 32, 16, 16).
    # Forward MACs: 2 images x 32 channels x 16*16 positions x 9 taps = 147,456 -> 294,912 FLOPs.
    x, w, go = meta(2, 32, 16, 16), meta(32, 1, 3, 3), meta(2, 32, 16, 16)
    forward = flops_of(aten.convolution.default, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 32,
                       outputs=(go,))  # fmt: skip
    assert forward == 294_912
    assert _conv_backward_call(x, w, go, 32, [True, True, False]) == 2 * 294_912
    assert _conv_backward_call(x, w, go, 32, [False, True, True]) == 294_912  # grad-weight only
    assert _conv_backward_call(x, w, go, 32, [True, False, False]) == 294_912  # grad-input only


def test_grouped_convolution_backward() -> None:
    # x (1, 8, 5, 5), w (16, 2, 3, 3), groups 4, no padding: output (1, 16, 3, 3); each output element
    # takes 2 channels x 9 taps = 18 MACs: 144 x 18 = 2,592 MACs -> 5,184 FLOPs per gradient.
    x, w, go = meta(1, 8, 5, 5), meta(16, 2, 3, 3), meta(1, 16, 3, 3)
    args = (go, x, w, [16], [1, 1], [0, 0], [1, 1], False, [0, 0], 4, [True, True, True])
    assert flops_of(aten.convolution_backward.default, *args) == 2 * 5_184


def test_dense_convolution_backward_agrees_with_torch() -> None:
    # torch's formula is right for groups == 1: the fixed one must give the same number.
    x, w, go = meta(2, 16, 12, 12), meta(24, 16, 3, 3), meta(2, 24, 12, 12)
    ours = _conv_backward_call(x, w, go, 1, [True, True, True])
    theirs = torch.utils.flop_counter.conv_backward_flop(  # type: ignore[call-arg]
        go.shape, x.shape, w.shape, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True],
        out_val=[x.shape, w.shape, (24,)],
    )  # fmt: skip
    assert ours == theirs == 2 * 2 * (2 * 24 * 12 * 12 * 16 * 9)


@pytest.mark.parametrize("is_causal", [False, True])
def test_cpu_flash_attention(is_causal: bool) -> None:
    # q, k, v (b=2, h=4, s=16, d=8): Q K^T and P V, each 2*b*h*s*s*d = 32,768 FLOPs -> 65,536 forward;
    # backward: the scores recomputed, dV, dP, dQ, dK = 5 products = 163,840. Causal: counted in full
    # (torch's convention).
    q = k = v = out = meta(2, 4, 16, 8)
    lse = meta(2, 4, 16)
    fwd = flops_of(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, is_causal)
    assert fwd == 4 * 2 * 4 * 16 * 16 * 8 == 65_536
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert flops_of(bwd_op, out, q, k, v, out, lse, 0.0, is_causal) == 163_840


def test_cpu_flash_attention_cross_and_grouped_query() -> None:
    # 8 query heads over 2 key/value heads, 10 queries against 24 keys, head dim 16.
    q, k, v = meta(1, 8, 10, 16), meta(1, 2, 24, 16), meta(1, 2, 24, 16)
    fwd = flops_of(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, False)
    assert fwd == 2 * (2 * 8 * 10 * 24 * 16)


def test_cpu_attention_is_found_in_a_fake_run() -> None:
    # On CPU, F.scaled_dot_product_attention dispatches the CPU flash kernel (unknown to torch's counter).
    class Attention(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    q = torch.randn(2, 4, 16, 8)
    model = nn.Sequential(nn.Linear(8, 8), Attention())
    flops = fake_flops(model, q, lambda m, b: m(b).sum(), optimizer=None)
    linear = 2 * 2 * 4 * 16 * 8 * 8
    assert flops.forward == linear + 65_536
    assert flops.backward == linear + 163_840  # the batch needs no gradient: Linear's weight's only
    sdpa = flops.module("1")
    assert sdpa is not None and sdpa.forward == 65_536 and sdpa.backward == 163_840


def test_mkldnn_lstm_layer() -> None:
    # (T=5, N=3, I=4) through an LSTM layer with H=6: per step and sequence W_ih (24 x 4) and W_hh (24 x 6).
    x, w_ih, w_hh, b = meta(5, 3, 4), meta(24, 4), meta(24, 6), meta(24)
    h = meta(3, 6)
    args: tuple[Any, ...] = (x, w_ih, w_hh, b, b, h, h, False, [], 2, 6, 1, True, False, False, True)
    forward = flops_of(aten.mkldnn_rnn_layer.default, *args)
    assert forward == 2 * 5 * 3 * (24 * 4 + 24 * 6)
    bwd_args: tuple[Any, ...] = (x, w_ih, w_hh, b, b, h, h, x, h, h, x, None, None)
    bwd_args += (False, 2, 6, 1, True, True, False, [], False, meta(0))
    assert flops_of(aten.mkldnn_rnn_layer_backward.default, *bwd_args) == 2 * forward


def test_matrix_products() -> None:
    a, b, c = meta(3, 5), meta(5, 7), meta(3, 7)
    assert flops_of(aten.mm.default, a, b, outputs=(c,)) == 2 * 3 * 5 * 7
    assert flops_of(aten.addmm.default, meta(7), a, b, outputs=(c,)) == 2 * 3 * 5 * 7
    assert flops_of(aten.bmm.default, meta(2, 3, 5), meta(2, 5, 7), outputs=(meta(2, 3, 7),)) == 420
    assert flops_of(aten.mv.default, a, meta(5)) == 30
    assert flops_of(aten.addbmm.default, c, meta(2, 3, 5), meta(2, 5, 7)) == 420


def test_other_flop_conventions() -> None:
    x = meta(4, 10)
    call = OpCall(aten._softmax.default, (x, 1, False), {}, (x,), "cpu")
    softmax = other_flop_formula_for(aten._softmax.default)
    assert softmax is not None and softmax(call) == 5 * 40
    norm = other_flop_formula_for(aten.native_layer_norm.default)
    assert norm is not None
    assert norm(OpCall(aten.native_layer_norm.default, (x, [10], None, None, 1e-5), {}, (x,), "cpu")) == 200
    total = other_flop_formula_for(aten.sum.dim_IntList)
    assert total is not None
    assert total(OpCall(aten.sum.dim_IntList, (x, [1]), {}, (meta(4),), "cpu")) == 40  # per input element
    assert other_flop_formula_for(aten.clone.default) is None  # copies are not arithmetic
    assert other_flop_formula_for(aten.add.Tensor) is not None
    assert other_flop_formula_for(aten.hardtanh_backward.default) is not None  # a pointwise op's backward


def test_capture_filter_skips_elementwise_and_views() -> None:
    assert captures_flops(aten.mm.default) and captures_flops(aten.convolution_backward.default)
    assert captures_flops(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert captures_flops(aten.mkldnn_rnn_layer.default) and captures_flops(aten.native_batch_norm.default)
    assert captures_flops(aten._foreach_add_.List) and captures_flops(aten.sum.dim_IntList)
    # Elementwise ops are counted from OpEvent.numel, without their call.
    assert not captures_flops(aten.add_.Tensor) and not captures_flops(aten.relu.default)
    assert not captures_flops(aten.view.default) and not captures_flops(aten.t.default)


def test_only_the_first_step_and_phases_that_ran() -> None:
    x, w, out = meta(4, 16), meta(16, 8), meta(4, 8)
    call = OpCall(aten.mm.default, (x, w), {}, (out,), "cpu")
    events = [
        OpEvent(0, 0, Phase.FORWARD, "a.b", "aten.mm.default", call, (0,)),
        OpEvent(1, 0, Phase.FORWARD, "a", "aten.relu.default", None, None, 32),
        OpEvent(2, 0, Phase.SETUP, "", "aten.mm.default", call, (1,)),  # not a step phase
        OpEvent(3, 1, Phase.FORWARD, "a.b", "aten.mm.default", call, (2,)),  # the second step
        OpEvent(4, 1, Phase.OPTIMIZER, "", "aten.add_.Tensor", None, None, 8),
    ]
    flops = count_flops(events)
    assert (flops.forward, flops.backward, flops.optimizer) == (1024, None, None)
    assert (flops.other_forward, flops.other_backward, flops.other_optimizer) == (32, None, None)
    assert [(m.path, m.forward, m.other_forward) for m in flops.modules] == [
        ("", 1024, 32),
        ("a", 1024, 32),
        ("a.b", 1024, 0),
    ]


# ------------------------------------------------------------------------------ whole fake runs

# (torchvision model, whether it is a convolutional net: backward/forward ~ 2)
VISION = [
    ("resnet18", True),
    ("resnet50", True),
    ("mobilenet_v2", True),
    ("efficientnet_b0", True),
    ("convnext_tiny", True),
    ("densenet121", True),
    ("vit_b_16", False),
]
BATCH = 2


@functools.cache
def vision_flops(name: str) -> FlopCount:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None)
    batch = (torch.randn(BATCH, 3, 224, 224), torch.randint(0, 1000, (BATCH,)))
    return fake_flops(model, batch, classification_loss)


@pytest.mark.parametrize(("name", "conv"), VISION)
def test_forward_matches_torchvision_published_gmacs(name: str, conv: bool) -> None:
    torchvision = pytest.importorskip("torchvision")
    gmacs = torchvision.models.get_model_weights(name).DEFAULT.meta["_ops"]
    expected = 2 * gmacs * 1e9 * BATCH
    flops = vision_flops(name)
    assert flops.forward == pytest.approx(expected, rel=0.01)
    assert flops.backward is not None
    if conv:
        assert 1.85 <= flops.backward / flops.forward <= 2.1
    # The optimizer (SGD with momentum) does elementwise work only: 3 FLOPs per parameter element.
    assert flops.optimizer == 0
    assert flops.other_optimizer is not None and flops.other_optimizer > 0
    assert flops.other_forward < 0.1 * flops.forward
    assert flops.uncounted == ()


def test_module_figures_include_their_children() -> None:
    flops = vision_flops("resnet18")
    root = flops.module("")
    assert root is not None and root.forward == flops.forward and root.backward == flops.backward
    layer1 = flops.module("layer1")
    blocks = [flops.module(f"layer1.{i}") for i in (0, 1)]
    assert layer1 is not None and all(b is not None for b in blocks)
    assert layer1.forward == sum(b.forward for b in blocks if b is not None) > 0
    assert layer1.backward == sum(b.backward for b in blocks if b is not None) > 0
    conv1 = flops.module("conv1")
    # 7x7 stride-2 conv, 3 -> 64 channels, 112x112 output: 118,013,952 MACs per image.
    assert conv1 is not None and conv1.forward == 2 * BATCH * 64 * 112 * 112 * 3 * 49
    assert conv1.backward == conv1.forward  # the image needs no gradient: grad-weight only
    paths = [m.path for m in flops.modules]
    assert paths.index("layer1") < paths.index("layer1.0") < paths.index("layer2")


def test_gpt_forward_is_2_n_tokens_plus_attention() -> None:
    # Convention (torch's): each layer's causal attention counts both seq x seq products in full,
    # 4 * batch * seq^2 * d_model FLOPs per layer; N counts the matrices of the linear layers (the
    # embeddings are lookups, biases are not multiplied).
    layers, d, vocab, seq, batch = 4, 256, 1000, 128, 2
    model = TinyGPT(n_layers=layers, d_model=d, n_heads=4, vocab=vocab, seq_len=seq)
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert n == layers * 12 * d * d + d * vocab
    tokens = batch * seq
    expected = 2 * n * tokens + layers * 4 * batch * seq * seq * d
    flops = fake_flops(model, lm_batch(batch, seq, vocab), lm_loss, steps=2)
    assert flops.forward == pytest.approx(expected, rel=0.01)
    assert flops.backward is not None and 1.95 <= flops.backward / flops.forward <= 2.1
    attn = flops.module("blocks.0.attn")
    assert attn is not None
    assert attn.forward == 2 * tokens * 4 * d * d + 4 * batch * seq * seq * d


def test_only_the_first_step_is_counted() -> None:
    model = TinyGPT(n_layers=1, d_model=32, n_heads=2, vocab=50, seq_len=8)
    batch = lm_batch(2, 8, vocab=50)
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    assert fake_flops(model, batch, lm_loss, steps=2, optimizer=adam) == fake_flops(
        model, batch, lm_loss, steps=1, optimizer=adam
    )


def test_lstm_counts_the_onednn_layer() -> None:
    embed, hidden, vocab, batch, seq = 32, 64, 100, 2, 16
    model = LSTMLanguageModel(vocab=vocab, embed=embed, hidden=hidden, layers=2)
    flops = fake_flops(model, lm_batch(batch, seq, vocab), lm_loss, optimizer=None)
    tokens = batch * seq
    lstm = 2 * tokens * 4 * hidden * ((embed + hidden) + (hidden + hidden))
    assert flops.forward == lstm + 2 * tokens * hidden * vocab
    assert flops.backward == pytest.approx(2 * flops.forward, rel=0.01)
    assert flops.optimizer is None and flops.other_optimizer is None


def test_agrees_with_torch_flop_counter_where_it_is_right() -> None:
    # A real step under FlopCounterMode (dense convolutions and linear layers: torch is right there).
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.get_model("resnet18", weights=None)
    images, targets = torch.randn(1, 3, 64, 64), torch.randint(0, 1000, (1,))
    with FlopCounterMode(display=False) as counter:
        loss = classification_loss(model, (images, targets))
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        loss.backward()  # type: ignore[no-untyped-call]
    backward = counter.get_total_flops()
    flops = fake_flops(model, (images, targets), classification_loss, optimizer=None)
    assert (flops.forward, flops.backward) == (forward, backward)


def test_elementwise_work_is_counted_without_capturing_it() -> None:
    # Linear(8, 4) -> ReLU on a (3, 8) batch, loss = sum. Forward: addmm 2*3*8*4 = 192; other: relu (12
    # outputs) + sum (12 inputs). Backward: mm for the weight's gradient (192); other: threshold_backward
    # (12 outputs) + the bias gradient's sum (12 inputs). SGD with momentum: 3 per parameter element.
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    flops = fake_flops(model, torch.randn(3, 8), lambda m, b: m(b).sum())
    assert (flops.forward, flops.other_forward) == (192, 24)
    assert (flops.backward, flops.other_backward) == (192, 24)
    assert flops.optimizer == 0
    relu = flops.module("1")
    assert relu is not None and (relu.other_forward, relu.other_backward) == (12, 12)
