"""Replay of repeated blocks (``engine.replay.block_replay``) and of the optimizer's work on their parameters
(``engine.replay.optimizer_replay``): the replayed estimate equals the full simulation's to the byte -- peaks
and breakdowns, per-module figures, FLOPs, the timeline, phase marks, the CUDA allocator's figures --
for every kind of model and optimizer it applies to; where the blocks do not repeat, it is off, and
said so; an optimizer it does not know runs as it always did."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

import lightning_memest.estimate as estimate_module
from lightning_memest import estimate_step
from lightning_memest.engine.replay.blocks import repeated_blocks
from lightning_memest.report import StepEstimate
from tests.models import TinyGPT, lm_batch, lm_loss


def _same(replayed: StepEstimate, full: StepEstimate) -> None:
    """Every figure equal but the seconds and the replay's own note."""
    assert full.replayed_blocks is None
    assert full.replay_note is None
    a = dataclasses.replace(replayed, estimate_seconds=0.0, replayed_blocks=None, replay_note=None)
    b = dataclasses.replace(full, estimate_seconds=0.0)
    assert a.peaks == b.peaks  # first: the clearest message
    assert a.modules == b.modules
    assert a.flops == b.flops
    assert a.timeline == b.timeline
    assert a == b


def _compare(
    model: nn.Module, batch: Any, expected: dict[str, int], updates: int | None = None, **kwargs: Any
) -> None:
    """Replayed and full estimates equal; ``updates``: the optimizer's parameter iterations replayed."""
    sims: list[Any] = []
    simulate = estimate_module.simulate

    def recorded(*args: Any, **kw: Any) -> Any:
        sims.append(simulate(*args, **kw))
        return sims[-1]

    with mock.patch.object(estimate_module, "simulate", recorded):
        replayed = estimate_step(model, batch, replay_blocks=True, **kwargs)
    assert replayed.replayed_blocks == expected
    if updates is not None:
        assert sims[-1].replayed_updates == updates
    _same(replayed, estimate_step(model, batch, replay_blocks=False, **kwargs))


def _replay_flags(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The ``replay_blocks`` of each simulation ``estimate_step`` runs from now on, in order."""
    runs: list[bool] = []
    simulate = estimate_module.simulate

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(kwargs["replay_blocks"])
        return simulate(*args, **kwargs)

    monkeypatch.setattr(estimate_module, "simulate", counted)
    return runs


def _hf_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def test_tiny_gpt_adamw() -> None:
    model = TinyGPT(n_layers=8, d_model=64, n_heads=4, vocab=100, seq_len=16)
    # 3 stand-ins x 12 parameters: the state made in step 1 (step 2's loop only appends it to the lists:
    # it runs), the updates of both steps
    _compare(
        model, lm_batch(2, 16, vocab=100), {"blocks": 3}, 108, loss_fn=lm_loss, optimizer=torch.optim.AdamW
    )


def test_tiny_gpt_cuda_what_if_bf16_mixed() -> None:
    """Through the CUDA caching allocator model (block rounding, segments): the same blocks too. The
    updates are CUDA's foreach kernels, which run whole; the state's creation (step 1) is replayed."""
    model = TinyGPT(n_layers=7, d_model=64, n_heads=4, vocab=100, seq_len=16)
    batch = lm_batch(2, 16, vocab=100)
    kwargs: dict[str, Any] = {"loss_fn": lm_loss, "optimizer": torch.optim.AdamW, "device": "cuda"}
    _compare(model, batch, {"blocks": 2}, 2 * 12, precision="bf16-mixed", **kwargs)


def test_llama_decoder() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    _compare(model, ids, {"model.layers": 3}, 3 * 9 * 3, loss_fn=_hf_loss, optimizer=torch.optim.AdamW)


def test_mixtral_experts_run_for_real_are_counted_for_the_stand_ins() -> None:
    """transformers' MoE experts take ``aten._grouped_mm``, whose fake kernel refuses float32 and which
    runs for real (``engine.real_ops``): the report counts its calls, the stand-ins' too."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    _compare(model, ids, {"model.layers": 3}, loss_fn=_hf_loss, optimizer=torch.optim.AdamW)
    full = estimate_step(model, ids, loss_fn=_hf_loss, optimizer=torch.optim.AdamW)
    assert full.real_ops  # (else there is nothing to count)


def test_gpt2_decoder() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=64, n_embd=64, n_layer=6, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 16))
    _compare(model, ids, {"transformer.h": 1}, 12 * 2, loss_fn=_hf_loss, optimizer=torch.optim.SGD)


def test_vit_encoder() -> None:
    vision_transformer = pytest.importorskip("torchvision.models.vision_transformer")
    model = vision_transformer.VisionTransformer(
        image_size=32, patch_size=8, num_layers=7, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    _compare(model, torch.randn(2, 3, 32, 32), {"encoder.layers": 2}, 2 * 12 * 3, optimizer=torch.optim.Adam)


def test_resnet_stage() -> None:
    """In-place ReLUs saving their outputs, batch norm's running statistics (buffers), a stage whose
    first block differs (its downsampling): the run of alike blocks starts after it."""
    resnet = pytest.importorskip("torchvision.models.resnet")
    model = resnet.ResNet(resnet.BasicBlock, [1, 1, 7, 1], num_classes=10)
    _compare(model, torch.randn(2, 3, 32, 32), {"layer3": 1}, 6 * 2, optimizer=torch.optim.SGD)


class _Scaled(nn.Module):
    """A block whose events depend on a flag no parameter shows."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.twice = twice

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.fc(x))
        return y * 2 if self.twice else y


def _stack(make: Callable[[int], nn.Module], n: int = 8) -> nn.Sequential:
    return nn.Sequential(*(make(i) for i in range(n)))


class _Planned(_Scaled):
    """A block that looks its kind up at forward time, in a plan all blocks share, keyed by the block
    itself (as a schedule kept outside the model would be): nothing the block holds tells it apart --
    its attributes are alike, the plan one object -- and it writes nothing on itself."""

    def __init__(self, plan: dict[int, bool]) -> None:
        super().__init__()
        self.plan = plan

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.fc(x))
        return y * 2 if self.plan.get(id(self), False) else y


def _planned(at: int) -> nn.Sequential:
    plan: dict[int, bool] = {}
    model = _stack(lambda i: _Planned(plan))
    plan[id(model[at])] = True
    return model


def test_on_by_default_off_by_the_flag_and_without_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = torch.randn(4, 16)
    assert estimate_step(_stack(lambda i: _Scaled()), batch).replayed_blocks == {"": 3}
    assert estimate_step(_stack(lambda i: _Scaled()), batch, replay_blocks=False).replayed_blocks is None
    # Blocks 1 and 2 differ (in what they do, not in what they are): no block is replayed, nothing
    # run twice.
    runs = _replay_flags(monkeypatch)
    model = _planned(2)
    est = estimate_step(model, batch)
    assert runs == [True] and est.replayed_blocks is None
    assert est.replay_note == "the model: the forwards differ"
    _same(est, estimate_step(model, batch, replay_blocks=False))


def test_a_mismatch_after_replay_simulates_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block N-2 (the backward's template, run after the stand-ins' forwards) differs: the replayed
    run is thrown away and the step simulated without replay."""
    runs = _replay_flags(monkeypatch)
    model = _planned(6)
    est = estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.SGD, replay_blocks=True)
    assert runs == [True, False]
    assert est.replayed_blocks is None
    assert est.replay_note is not None and est.replay_note.startswith("simulated again without replay: ")
    _same(est, estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.SGD, replay_blocks=False))


def test_a_replayed_run_that_fails_otherwise_simulates_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in that breaks (here: made to raise, as an untested device could) costs a second run,
    never the estimate: the step is simulated again without replay."""
    from lightning_memest.engine.replay.block_replay import BlockReplay

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a stand-in that cannot be made here")

    monkeypatch.setattr(BlockReplay, "_stand_in", broken)
    runs = _replay_flags(monkeypatch)
    model = _stack(lambda i: _Scaled())
    est = estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.SGD)
    assert runs == [True, False]
    assert est.replayed_blocks is None
    _same(est, estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.SGD, replay_blocks=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_replay_on_fake_cuda_tensors() -> None:
    """On a GPU the step runs on fake CUDA tensors: stand-ins make CUDA fake tensors, and every figure
    (the caching allocator's too) equals the full simulation's."""
    model = TinyGPT(n_layers=8, d_model=64, n_heads=4, vocab=100, seq_len=16)
    _compare(
        model,
        lm_batch(2, 16, 100),
        {"blocks": 3},
        loss_fn=lm_loss,
        optimizer=torch.optim.AdamW,
        device="cuda",
    )


def test_groups_need_alike_blocks_without_hooks() -> None:
    assert [len(g.members) for g in repeated_blocks(_stack(lambda i: _Scaled()))] == [8]
    assert repeated_blocks(_stack(lambda i: _Scaled(), n=5)) == []  # too few to replay one
    shared = _Scaled()
    assert repeated_blocks(nn.Sequential(*([shared] * 8))) == []  # one module eight times
    hooked = _stack(lambda i: _Scaled())
    hooked[3].fc.register_forward_hook(lambda *_: None)  # the user's hook on a child: it must run
    assert repeated_blocks(hooked) == []  # 0-2 and 4-7 alike, too few on either side
    widths = nn.Sequential(*(nn.Linear(8 + i, 8 + i + 1) for i in range(8)))
    assert repeated_blocks(widths) == []


class _Rotary(nn.Module):
    """A layer whose kind is a plain attribute set from its index (Llama 4's NoPE layers: every fourth
    without the rotary op), the parameters the same in every kind."""

    def __init__(self, layer_idx: int, period: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.layer_idx = layer_idx
        self.use_rope = (layer_idx + 1) % period != 0

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        return torch.cat([-y[..., 8:], y[..., :8]], dim=-1) * 0.5 + y if self.use_rope else y


def test_blocks_of_another_kind_never_stand_in() -> None:
    """Layers 3 and 7 of twelve skip the rotary op (blocks 1, 2 and N-2 all have it): no block of the
    other kind is replayed from a template of this one (three periods of four kinds: too few to
    replay); the layer index, a distinct number per layer, is not a kind."""
    model = _stack(_Rotary, n=12)
    assert repeated_blocks(model) == []
    est = estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.SGD, replay_blocks=True)
    assert est.replayed_blocks is None
    _same(est, estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.SGD, replay_blocks=False))
    # One kind after another, each run long enough: both replayed, each from its own template.
    kinds = nn.Sequential(*(_Rotary(i, period=1 if i < 8 else 100) for i in range(16)))
    assert [len(g.members) for g in repeated_blocks(kinds)] == [8, 8]
    _compare(kinds, torch.randn(4, 16), {"": 6}, optimizer=torch.optim.SGD)


def test_kinds_in_turn_are_replayed_each_from_its_own_template() -> None:
    """48 layers, every fourth without the rotary op: a group of period 4, each kind replayed from
    its own blocks (periods 3 .. 9 of 12 stand in: 28 blocks), the optimizer's work on them too."""
    model = _stack(_Rotary, n=48)
    [group] = repeated_blocks(model)
    assert (len(group.members), group.period) == (48, 4)
    _compare(model, torch.randn(4, 16), {"": 28}, 28 * 2 * 3, optimizer=torch.optim.AdamW)


def test_gemma2_alternating_sliding_window_layers() -> None:
    """transformers' Gemma 2: sliding-window and global attention in turn (a kind set from the layer
    index at init, ``is_sliding``), norms after each block: replayed as a group of period 2."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(config)
    assert [g.period for g in repeated_blocks(model)] == [2]
    ids = torch.randint(0, 128, (2, 16))
    _compare(model, ids, {"model.layers": 2}, loss_fn=_hf_loss, optimizer=torch.optim.AdamW)


class _Mlp(nn.Module):
    """A block with weights, biases and a norm: parameters of three shapes, two without decay."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _split_groups(make: Callable[..., torch.optim.Optimizer]) -> Callable[[Any], torch.optim.Optimizer]:
    """Decay for matrices only, in two parameter groups (as LLM recipes do): each block's parameters
    are spread over both lists."""

    def build(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        return make([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])

    return build


@pytest.mark.parametrize(
    ("optimizer", "updates"),
    [
        # L2 decay: the gradient plus decay is a temporary that dies in the next parameter's iteration;
        # amsgrad: a fourth list, a fourth state tensor. 3 stand-ins x 6 parameters x (the state's
        # creation in step 1 + an update in each of 3 steps).
        (lambda ps: torch.optim.Adam(ps, weight_decay=0.1, amsgrad=True), 3 * 6 * (1 + 3)),
        (_split_groups(torch.optim.AdamW), 3 * 6 * (1 + 3)),
        # Momentum buffers are made by step 1's updates (they outlive them: that step runs whole), then
        # updated in place: steps 2 and 3 replayed.
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4), 3 * 6 * 2),
        (lambda ps: torch.optim.AdamW(ps, foreach=True), 3 * 6),  # the state's creation only
        (lambda ps: torch.optim.AdamW(ps, maximize=True), 3 * 6 * (1 + 3)),
        (torch.optim.RMSprop, 0),  # not one it knows: run as always
    ],
    ids=["adam-l2-amsgrad", "adamw-groups", "sgd-momentum", "adamw-foreach", "adamw-maximize", "rmsprop"],
)
def test_optimizer_updates(optimizer: Callable[[Any], torch.optim.Optimizer], updates: int) -> None:
    """Three steps: the state is made in the first, read and updated in the next two."""
    model = _stack(lambda i: _Mlp())
    _compare(model, torch.randn(4, 16), {"": 3}, updates, optimizer=optimizer, steps=3)


def test_optimizer_loop_run_otherwise_is_simulated_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """An update function that goes over its list twice (the second time after the stand-ins were
    replayed): the replayed run is thrown away and the steps simulated without replay."""
    import torch.optim.adam as adam_module

    single = adam_module._single_tensor_adam

    def twice(params: list[Tensor], *args: Any, **kwargs: Any) -> None:
        single(params, *args, **kwargs)
        for p in params:
            p.mul_(1.0)

    monkeypatch.setattr(adam_module, "_single_tensor_adam", twice)
    runs = _replay_flags(monkeypatch)
    model = _stack(lambda i: _Mlp())
    est = estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.Adam, replay_blocks=True)
    assert runs == [True, False]
    assert est.replayed_blocks is None
    _same(est, estimate_step(model, torch.randn(4, 16), optimizer=torch.optim.Adam, replay_blocks=False))


def test_layouts_read_again_after_an_op_that_can_change_them() -> None:
    """The optimizer's replay reads each stand-in entry's layout from what was read or made before
    (``ReplayTracker.handle_and_layout``) only while nothing could have changed it: after an in-place
    view, ``resize_`` or ``set_``, it reads it again; after in-place arithmetic, not."""
    from lightning_memest.engine.replay.replay_tracker import ReplayTracker
    from lightning_memest.engine.tracker import Tracker
    from lightning_memest.engine.tracking_mode import TrackingFakeTensorMode

    tracker = ReplayTracker()
    mode = TrackingFakeTensorMode(tracker)
    with mode:
        t = torch.empty(4, 8)
        other = torch.empty(4, 8)

    def now() -> tuple[int | None, tuple[Any, ...]]:
        return Tracker.handle_and_layout(tracker, t)  # read in full

    def vouch_stale() -> tuple[Any, ...]:
        """Vouch for a layout ``t`` does not have (its strides marked): what a stale answer would be."""
        handle, layout = now()
        stale = (*layout[:2], ("stale",), *layout[3:])
        assert handle is not None
        tracker.vouch(t, handle, stale)
        return stale

    assert tracker.handle_and_layout(t) == now()
    stale = vouch_stale()
    assert tracker.handle_and_layout(t)[1] == stale  # answered from what was vouched
    with mode:
        t.add_(1.0)
        t.copy_(other)
    assert tracker.handle_and_layout(t)[1] == stale  # in-place arithmetic changes no layout
    changes: list[Callable[[], Any]] = [  # the same shape, other strides: only the ops say
        lambda: t.as_strided_((4, 8), (1, 4)),
        lambda: t.set_(t.untyped_storage(), 0, (4, 8), (8, 1)),
        lambda: t.resize_(2, 3),
        lambda: t.set_(other.untyped_storage(), 0, (4, 8), (8, 1)),
    ]
    for change in changes:
        vouch_stale()
        with mode:
            change()
        assert tracker.handle_and_layout(t) == now()
