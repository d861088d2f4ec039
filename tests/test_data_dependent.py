"""Every data-dependent op has a policy (issue 13, item 2): the enumeration of PyTorch's tags, each policy's
answer against the real kernel's output where the inputs make it largest, and the everyday cases end to end
(``torch.unique`` and ``bincount`` in a loss, a packed LSTM exact against the CPU allocator, torchmetrics
in the loss function, torchvision's ``batched_nms`` over more than 4000 boxes)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_memest import EstimationError, estimate_step
from lightning_memest.engine.events import DataDependent
from lightning_memest.engine.real_path import real_path
from lightning_memest.engine.step import StepConfig
from lightning_memest.engine.tracker import Tracker, real_value
from lightning_memest.engine.tracking_mode import TrackingFakeTensorMode
from lightning_memest.engine.values import data_dependent
from lightning_memest.engine.values.nonzero_bounds import nonzero_bound
from lightning_memest.engine.values.value_sets import values_in
from lightning_memest.measure import measure_step

aten = torch.ops.aten

#: Ops the issue names besides the tagged ones (some are tagged too).
NAMED = [
    aten._local_scalar_dense.default,
    aten._pack_padded_sequence.default,
    aten.repeat_interleave.Tensor,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten.bincount.default,
    aten.histc.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.index.Tensor,
    torch.ops.torchvision.nms.default,
]


def tagged_ops() -> list[OpOverload]:
    """Every overload of every aten op PyTorch tags ``dynamic_output_shape`` or ``data_dependent_output``
    (all registered ops, not only those ``torch.ops.aten`` has loaded)."""
    tags = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
    names = {n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()}
    found = []
    for name in sorted(n for n in names if n):
        packet = getattr(aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():  # type: ignore[no-untyped-call]
            op = getattr(packet, overload)
            if any(tag in op.tags for tag in tags):
                found.append(op)
    return found


def covered(op: OpOverload) -> bool:
    return data_dependent.policy_of(op) is not None or any(
        key in data_dependent.FAKE_KERNEL_SUFFICES for key in (op, op.overloadpacket)
    )


def test_every_tagged_and_named_op_has_a_policy() -> None:
    tagged = tagged_ops()
    assert aten._unique2.default in tagged and aten._local_scalar_dense.default in tagged  # the walk works
    assert len(tagged) >= 20
    missing = [str(op) for op in [*tagged, *NAMED] if not covered(op)]
    assert not missing, f"data-dependent ops without a policy: {missing}"


# --- ops whose fake kernel needs no policy -----------------------------------------------------------------
FAKE_KERNEL_CALLS: dict[Any, Callable[[], Any]] = {
    aten.histc: lambda: torch.histc(torch.randn(10), bins=7),
    aten.histogram: lambda: torch.histogram(torch.randn(10), bins=4),
    aten.nonzero_static: lambda: torch.nonzero_static(torch.randn(3, 3), size=4),
    aten.index_put: lambda: torch.randn(3, 3).index_put((torch.randn(3, 3) > 0,), torch.tensor(1.0)),
    aten.index_put_: lambda: torch.randn(3, 3).index_put_((torch.randn(3, 3) > 0,), torch.tensor(1.0)),
    aten.masked_scatter: lambda: torch.randn(3, 3).masked_scatter(torch.randn(3, 3) > 0, torch.randn(9)),
}


def test_ops_said_to_need_no_policy_run_on_the_fake_kernel() -> None:
    assert set(FAKE_KERNEL_CALLS) == set(data_dependent.FAKE_KERNEL_SUFFICES)
    for call in FAKE_KERNEL_CALLS.values():
        with FakeTensorMode():
            out = call()
        assert all(isinstance(t, Tensor) for t in (out if isinstance(out, tuple) else (out,)))
    # repeat_interleave with its output size given needs no policy either
    with FakeTensorMode():
        assert torch.repeat_interleave(torch.tensor([1, 2, 3]), output_size=6).shape == (6,)


# --- each policy against the real kernel at its largest output ---------------------------------------------
def _boxes(n: int) -> Tensor:
    x = torch.arange(n, dtype=torch.float32) * 10  # disjoint boxes: nms keeps them all
    return torch.stack([x, torch.zeros(n), x + 5, torch.full((n,), 5.0)], dim=1)


#: (op, inputs that make the real output as large as the inputs allow, extra keyword arguments)
WORST_CASES: list[tuple[OpOverload, Callable[[], tuple[Any, ...]], dict[str, Any]]] = [
    (aten.nonzero.default, lambda: (torch.ones(3, 4),), {}),
    (aten.argwhere.default, lambda: (torch.ones(3, 4),), {}),
    (aten.masked_select.default, lambda: (torch.randn(3, 4), torch.ones(4, dtype=torch.bool)), {}),
    (aten.index.Tensor, lambda: (torch.randn(3, 4, 2), [torch.ones(3, 4, dtype=torch.bool)]), {}),
    (aten._unique2.default, lambda: (torch.arange(6.0), True, True, True), {}),
    (aten._unique.default, lambda: (torch.arange(6.0), True, True), {}),
    (aten.unique_dim.default, lambda: (torch.arange(12.0).view(4, 3), 0, True, False, False), {}),
    (aten.unique_consecutive.default, lambda: (torch.arange(5), True, True), {}),
    (aten.unique_dim_consecutive.default, lambda: (torch.arange(12).view(3, 4), 1), {}),
    (aten.bincount.default, lambda: (torch.arange(9) % 7,), {"minlength": 7}),
    (aten.bincount.default, lambda: (torch.arange(9),), {}),
    (aten.bincount.default, lambda: (torch.arange(5) % 3, torch.ones(5)), {"minlength": 3}),
    (aten.repeat_interleave.Tensor, lambda: (torch.ones(5, dtype=torch.long),), {}),
    (aten._pack_padded_sequence.default, lambda: (torch.randn(4, 7, 3), torch.full((4,), 7), True), {}),
    (aten._pack_padded_sequence.default, lambda: (torch.randn(7, 4, 3), torch.full((4,), 7), False), {}),
    (aten._ctc_loss.Tensor, lambda: _ctc_inputs(lengths_as_tensors=True), {}),
    (aten._ctc_loss.default, lambda: _ctc_inputs(lengths_as_tensors=False), {}),
    (aten.linalg_lstsq.default, lambda: (torch.randn(6, 3), torch.randn(6, 2)), {}),
    (aten.linalg_lstsq.default, lambda: (torch.randn(2, 6, 3), torch.randn(2, 6)), {"driver": "gelsd"}),
    (aten.linalg_lstsq.default, lambda: (torch.randn(3, 6), torch.randn(3, 2)), {"driver": "gels"}),
    (torch.ops.torchvision.nms.default, lambda: (_boxes(6), torch.rand(6), 0.5), {}),
]


def _ctc_inputs(lengths_as_tensors: bool) -> tuple[Any, ...]:
    log_probs = torch.randn(10, 2, 5).log_softmax(-1)
    targets = torch.randint(1, 5, (2, 4))
    input_lengths, target_lengths = [10, 9], [4, 4]  # the longest targets the (2, 4) targets allow
    if lengths_as_tensors:
        return log_probs, targets, torch.tensor(input_lengths), torch.tensor(target_lengths), 0, False
    return log_probs, targets, input_lengths, target_lengths, 0, False


def _shapes(out: Any) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
    leaves = out if isinstance(out, (tuple, list)) else [out]
    return [(tuple(t.shape), t.dtype, t.device) for t in leaves if isinstance(t, Tensor)]


@pytest.mark.parametrize(
    "op,inputs,kwargs", WORST_CASES, ids=lambda v: str(v) if isinstance(v, OpOverload) else ""
)
def test_policy_answers_the_largest_real_output(
    op: OpOverload, inputs: Callable[[], tuple[Any, ...]], kwargs: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    args = inputs()
    real = op(*args, **kwargs)
    tracker = Tracker()
    mode = TrackingFakeTensorMode(tracker)
    fake_args = tuple(
        mode.from_tensor(a)
        if isinstance(a, Tensor)
        else [mode.from_tensor(t) for t in a]
        if isinstance(a, list) and a and isinstance(a[0], Tensor)
        else a
        for a in args
    )
    with mode:
        fake = op(*fake_args, **kwargs)
    assert _shapes(fake) == _shapes(real)
    reads = [e for e in tracker.events if isinstance(e, DataDependent)]
    if op is not aten._ctc_loss.default:  # its lengths are plain numbers: nothing is assumed
        assert reads and reads[-1].assumed
        # (argwhere is decomposed: its read is nonzero's)
        assert reads[-1].op == str(op if op is not aten.argwhere.default else aten.nonzero.default)


def test_scalar_reads_of_unknown_values_are_neutral() -> None:
    tracker = Tracker()
    with TrackingFakeTensorMode(tracker):
        x = torch.randn(3)
        y = torch.randn(3)
        values = (int((x > 0).sum()), float(x.sum()), bool(x.any()), torch.equal(x, y), x.allclose(y))
        same = (torch.equal(x, x), x.allclose(x), torch.equal(x[1:], x[1:]), torch.equal(x[1:], x[:2]))
    assert values == (0, 0.0, False, False, False)
    assert same == (True, True, True, False)  # a tensor equals itself, a view its own elements
    assert [e.assumed for e in tracker.events if isinstance(e, DataDependent)] == ["0", "0.0", "False"] + [
        "False"
    ] * 2 + ["True (the same elements)"] * 3 + ["False"]


def test_out_overloads_are_sized_like_the_functional_answer() -> None:
    tracker = Tracker()
    with TrackingFakeTensorMode(tracker):
        out = torch.empty(0, dtype=torch.long)
        torch.nonzero(torch.randn(3, 4), out=out)
    assert out.shape == (12, 2)


def test_known_values_make_the_answer_exact_and_picked_values_bound_unique() -> None:
    tracker = Tracker()
    mode = TrackingFakeTensorMode(tracker)
    with real_path(mode), mode:  # as the simulation runs
        x = torch.randn(4, 6)
        levels = torch.tensor([0, 1, 2]).repeat(4)  # known: numbers in the code
        exact = torch.unique(levels)  # runs for real: nothing assumed
        picked = levels[x.argmax(0)]  # unknown indices into known values: values among {0, 1, 2}
        classes = torch.unique(picked)
        positions = torch.unique(x.argmax(1))  # 4 positions along 6 columns: all 4 distinct at most
    assert (exact.shape, classes.shape, positions.shape) == ((3,), (3,), (4,))
    assumed = [e.assumed for e in tracker.events if isinstance(e, DataDependent)]
    assert assumed == ["all 3 possible values present", "all 4 values distinct"]


# --- end to end through estimate_step ----------------------------------------------------------------------
def _reads(est: Any) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for read in est.data_dependent or ():
        found.setdefault(read.op, []).append(read.assumed)
    return found


def test_unique_and_bincount_in_a_loss() -> None:
    def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = model(x)
        predicted = logits.argmax(-1)
        # class-balanced loss: weights from the classes present in the batch and the predictions
        present = torch.unique(torch.cat([y, predicted]))
        counts = torch.bincount(predicted, minlength=5).float()
        noise = torch.unique(logits.detach())  # unknown floats: every element distinct
        loss: Tensor = F.cross_entropy(logits, y) * len(present) + counts.sum() * 0 + noise.sum() * 0
        return loss

    batch = (torch.randn(16, 8), torch.randint(0, 5, (16,)))
    est = estimate_step(nn.Linear(8, 5), batch, loss_fn=loss_fn, optimizer=torch.optim.Adam)
    reads = _reads(est)
    assert sorted(set(reads["aten._unique2.default"])) == [
        "all 5 possible values present",
        "all 80 values distinct",
    ]
    assert set(reads["aten.bincount.default"]) == {"values up to 4 (of those possible)"}


class PackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True)
        return self.head(padded)  # type: ignore[no-any-return]


def test_packed_lstm_packs_the_batch_lengths_and_is_exact() -> None:
    def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        x, lengths, y = batch
        logits = model(x, lengths)
        return F.cross_entropy(logits.flatten(0, 1), y[:, : int(lengths.max())].flatten())

    torch.manual_seed(0)
    lengths = torch.tensor([20, 31, 9, 40, 14, 3])
    batch = (torch.randn(6, 40, 16), lengths, torch.randint(0, 4, (6, 40)))
    model = PackedLSTM()
    est = estimate_step(model, batch, loss_fn=loss_fn, optimizer=torch.optim.Adam)
    assert _reads(est)["aten._pack_padded_sequence.default"] == ["the real lengths (117 of 6x40 steps)"]
    assert "_pad_packed_sequence" not in vars(torch._VF)  # the simulation's stand-in is gone again
    real = measure_step(model, batch, StepConfig(loss_fn=loss_fn, optimizer=torch.optim.Adam))
    for estimated, measured in (
        (est.first_step.bytes, real.first_step),
        (est.steady_state.bytes, real.steady_state),
    ):
        assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)


def test_packed_sequence_of_unknown_lengths_assumes_full_lengths() -> None:
    def loss_fn(model: nn.Module, x: Tensor) -> Tensor:
        lengths = (x[:, :, 0] > -10).sum(1).cpu()  # computed: values unknown
        return model(x, lengths).sum()  # type: ignore[no-any-return]

    est = estimate_step(PackedLSTM(), torch.randn(3, 5, 16), loss_fn=loss_fn)
    assert _reads(est)["aten._pack_padded_sequence.default"] == ["every sequence full length (5)"]


class Classifier(nn.Module):
    """A module with its metric as a submodule, updated in the loss function (torchmetrics' usage)."""

    def __init__(self, validate_args: bool) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.net = nn.Linear(8, 5)
        self.accuracy = MulticlassAccuracy(num_classes=5, validate_args=validate_args)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("validate_args", [True, False])
def test_torchmetrics_accuracy_updated_in_the_loss(validate_args: bool) -> None:
    def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = model(x)
        model.accuracy.update(logits, y)  # type: ignore[operator,union-attr]
        return F.cross_entropy(logits, y)

    model = Classifier(validate_args)
    est = estimate_step(
        model, (torch.randn(16, 8), torch.arange(16) % 5), loss_fn=loss_fn, optimizer=torch.optim.SGD
    )
    # the confusion matrix's bins, num_classes**2: the value sets work out ``target * 5 + preds`` from
    # the batch's classes and argmax's positions
    assert _reads(est)["aten.bincount.default"] == ["values up to 24 (of those possible)"]
    # the metric's state is the real one again
    assert type(model.accuracy.tp) is Tensor and int(model.accuracy.tp.sum()) == 0


class Detections(nn.Module):
    """Scores and refines boxes, then keeps torchvision's batched_nms survivors."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 8)

    def forward(self, boxes: Tensor, classes: Tensor | None = None) -> Tensor:
        out = self.head(boxes)
        scores, predicted = out[:, 4:].max(-1)
        keep = torchvision.ops.batched_nms(
            boxes + out[:, :4], scores, predicted if classes is None else classes, 0.5
        )
        return out[keep].sum()  # type: ignore[no-any-return]


def test_batched_nms_over_4000_boxes() -> None:
    # Above 1000 boxes (4000 coordinates) torchvision's CPU batched_nms loops over torch.unique(classes).
    torch.manual_seed(0)
    n = 4100
    corner = torch.rand(n, 2) * 100
    boxes = torch.cat([corner, corner + torch.rand(n, 2) * 20 + 1], 1)
    classes = torch.randint(0, 3, (n,))
    sizes = torch.bincount(classes).tolist()

    est = estimate_step(Detections(), (boxes, classes), loss_fn=lambda m, b: m(*b), optimizer=torch.optim.SGD)
    reads = _reads(est)
    # the batch's classes are known: unique is exact (listed so), nms of each class keeps all of it
    assert reads["aten._unique2.default"] == ["the real size"]
    assert all(r.exact for r in est.data_dependent or () if r.op == "aten._unique2.default")
    assert sorted(reads["torchvision.nms.default"]) == sorted(f"every box kept ({k})" for k in sizes)

    # classes predicted by the model: unknown, but positions along 4 columns -- 4 nms calls, not 4100
    est = estimate_step(Detections(), boxes, loss_fn=lambda m, b: m(b), optimizer=torch.optim.SGD)
    reads = _reads(est)
    assert reads["aten._unique2.default"] == ["all 4 possible values present"]
    assert reads["torchvision.nms.default"] == [f"every box kept ({n})"]
    assert est.data_dependent is not None
    assert sum(r.count for r in est.data_dependent if r.op == "torchvision.nms.default") == 4 * 2  # 2 steps


@torch.library.custom_op("memest_test::keep_positive", mutates_args=())
def keep_positive(x: Tensor) -> Tensor:
    """A user's op whose output size depends on values, with a fake kernel that says so."""
    return x[x > 0].clone()


@keep_positive.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(torch.library.get_ctx().new_dynamic_size())


def test_a_data_dependent_op_without_policy_names_op_and_module() -> None:
    class Keep(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return keep_positive(x).sum() * x.sum()  # type: ignore[no-any-return]

    model = nn.Sequential(nn.Linear(4, 4), Keep())
    with pytest.raises(EstimationError) as info:
        estimate_step(model, torch.randn(3, 4))
    assert info.value.op == "memest_test.keep_positive.default" and info.value.module == "1"
    assert "keep_positive" in str(info.value) and "'1'" in str(info.value)
    # the model is restored even after a failure
    assert type(model[0].weight) is nn.Parameter and not hasattr(model[0].weight, "fake_mode")


# --- bounds on how many elements are nonzero (engine.values.nonzero_bounds) --------------------------------
def _set7() -> Tensor:
    """A zero mask with 7 positions set at unknown places (the sampler's pattern)."""
    mask = torch.zeros(100, dtype=torch.uint8)
    mask[torch.randperm(100)[:7]] = 1
    return mask


def _set9() -> Tensor:
    mask = torch.zeros(100, dtype=torch.bool)
    mask[torch.randperm(100)[:9]] = True
    return mask


def _through_view() -> Tensor:
    mask = _set7()
    mask.view(10, 10)[torch.randint(0, 10, (3,))] = 1  # a write through a view the base does not see
    return mask


#: (what, code making an integer or boolean tensor from unknown values, the bound it must get)
BOUNDS: list[tuple[str, Callable[[], Tensor], int]] = [
    ("zeros", lambda: torch.zeros(100, dtype=torch.long), 0),
    ("new_zeros", lambda: torch.randint(0, 5, (100,)).new_zeros(30), 0),
    ("full 0", lambda: torch.full((100,), 0), 0),
    ("ones", lambda: torch.ones(100, dtype=torch.bool), 100),
    ("unknown", lambda: torch.randint(0, 5, (100,)), 100),
    ("index_put_", _set7, 7),
    (
        "two writes",
        lambda: _set7().index_put_((torch.randperm(100)[:5],), torch.tensor(3, dtype=torch.uint8)),
        12,
    ),
    (
        "writing zeros",
        lambda: _set7().index_put_((torch.randperm(100)[:50],), torch.tensor(0, dtype=torch.uint8)),
        7,
    ),
    ("x[mask] = v", lambda: torch.zeros(100, dtype=torch.long).index_put_((_set9(),), torch.tensor(4)), 9),
    (
        "index_fill_",
        lambda: torch.zeros(10, 10, dtype=torch.long).index_fill_(0, torch.randperm(10)[:3], 1),
        30,
    ),
    ("masked_fill", lambda: torch.zeros(100, dtype=torch.long).masked_fill(_set9(), 2), 9),
    ("masked_fill 0", lambda: _set7().masked_fill(torch.randint(0, 2, (100,)).bool(), 0), 7),
    ("scatter_", lambda: torch.zeros(100, dtype=torch.long).scatter_(0, torch.randperm(100)[:5], 1), 5),
    (
        "scatter_add_",
        lambda: _set7().long().scatter_add_(0, torch.randperm(100)[:50], _set9().long()[:50]),
        16,
    ),
    ("copy_", lambda: torch.empty(100, dtype=torch.long).copy_(_set7()), 7),
    ("a | b", lambda: _set7() | _set9(), 16),
    ("a | b capped", lambda: torch.randint(0, 2, (100,)).bool() | _set9(), 100),
    ("logical_or", lambda: torch.logical_or(_set7(), _set9()), 16),
    ("a & b", lambda: torch.randint(0, 2, (100,)).bool() & _set9(), 9),
    ("a * b", lambda: torch.randint(0, 5, (100,)) * _set7(), 7),
    ("a + b", lambda: _set7().long() + _set9().long(), 16),
    ("where", lambda: torch.where(_set9(), torch.randint(0, 5, (100,)), _set7().long()), 16),
    ("view, permute, clone", lambda: _set7().view(10, 10).t().clone().reshape(-1), 7),
    ("casts", lambda: _set7().bool().long().to(torch.int8), 7),
    ("flip", lambda: _set7().flip(0), 7),
    ("slice", lambda: _set7()[20:60], 7),
    ("slice smaller", lambda: _set7()[:5], 5),
    ("unbind", lambda: _set7().view(10, 10).unbind(0)[3], 7),
    ("expand", lambda: _set7().view(1, 100).expand(3, 100), 21),
    ("repeat", lambda: _set7().repeat(2), 14),
    ("boolean pick", lambda: torch.randint(0, 5, (100,))[_set9()], 9),
    ("pick of zeros", lambda: torch.zeros(100, dtype=torch.long)[torch.randint(0, 100, (300,))], 0),
    ("cat", lambda: torch.cat([_set7(), _set9().to(torch.uint8)]), 16),
    ("x == 2", lambda: (torch.randint(0, 5, (100,)) * _set7()) == 2, 7),
    ("x >= 1", lambda: (torch.randint(0, 5, (100,)) * _set7()) >= 1, 7),
    ("x != 0", lambda: (torch.randint(0, 5, (100,)) * _set7()) != 0, 7),
    ("x == 0", lambda: (torch.randint(0, 5, (100,)) * _set7()) == 0, 100),
    ("x <= 0", lambda: (torch.randint(0, 5, (100,)) * _set7()) <= 0, 100),
    ("x == v, v not possible", lambda: torch.arange(5)[torch.randint(0, 5, (100,))] == 7, 0),
    ("a != b", lambda: _set7() != _set9().to(torch.uint8), 16),
    ("clamp keeping 0", lambda: (torch.randint(-5, 5, (100,)) * _set7()).clamp(min=0), 7),
    ("clamp moving 0", lambda: (torch.randint(-5, 5, (100,)) * _set7()).clamp(min=1), 100),
    ("x % 3", lambda: (torch.randint(0, 5, (100,)) * _set7()) % 3, 7),
    ("sum", lambda: _set9().view(10, 10).sum(1), 9),
    ("sum of all", lambda: _set9().sum(), 1),
    ("any", lambda: _set9().view(10, 10).any(0), 9),
    ("sort values", lambda: _set7().sort().values, 7),
    ("max(a, b)", lambda: torch.max(_set7(), _set9().to(torch.uint8)), 16),
    ("written through a view", _through_view, 100),
    (
        "floats carry none: 0 * inf",
        lambda: torch.zeros(100, dtype=torch.long) * torch.full((100,), math.inf),
        100,
    ),
]


@pytest.mark.parametrize("case,expected", [(c, e) for _, c, e in BOUNDS], ids=[w for w, _, _ in BOUNDS])
def test_nonzero_bounds_hold_and_are_tight(case: Callable[[], Tensor], expected: int) -> None:
    # Sound: no real run of the code has more nonzero elements than the bound; tight: the bound is the
    # count the code allows.
    most = 0
    for seed in range(8):
        torch.manual_seed(seed)
        most = max(most, int(torch.count_nonzero(case())))
    mode = TrackingFakeTensorMode(Tracker())
    with real_path(mode), mode:  # as the simulation runs
        fake = case()
    bound = nonzero_bound(fake, real_value)
    assert most <= bound == expected


def test_selections_output_at_most_the_bound() -> None:
    tracker = Tracker()
    mode = TrackingFakeTensorMode(tracker)
    with real_path(mode), mode:
        x = torch.randn(100, 3)
        pos, neg = _set7(), _set9()
        sampled = torch.where(pos | neg)[0]  # torchvision's BalancedPositiveNegativeSampler
        shapes = [
            sampled.shape,
            torch.argwhere(pos.view(10, 10)).shape,
            torch.nonzero(neg).shape,
            x[neg].shape,
            x.masked_select(neg.unsqueeze(1)).shape,
            torch.unique(torch.randint(0, 50, (100,)) * pos).shape,  # 7 nonzero values, and 0
        ]
    assert shapes == [(16,), (7, 2), (9, 1), (9, 3), (27,), (8,)]
    assumed = [e.assumed for e in tracker.events if isinstance(e, DataDependent)]
    assert assumed == [
        "16 of 100 nonzero (the most the ops that made it allow)",
        "7 of 100 nonzero (the most the ops that made it allow)",
        "9 of 100 nonzero (the most the ops that made it allow)",
        "9 of 100 of the mask set (the most the ops that made it allow)",
        "27 of 300 selected (the most the ops that made it allow)",
        "all 8 values distinct (at most 7 nonzero, and 0)",
    ]


def test_clamped_floats_cast_to_a_set_of_levels() -> None:
    # torchvision's FPN LevelMapper: levels from box sizes, clamped to the pyramid's; with one level
    # (every feature map of one stride) no box is on level 1.
    def levels(k_min: int, k_max: int) -> Tensor:
        s = torch.rand(50) * 300
        target = torch.floor(4 + torch.log2(s / 224) + torch.tensor(1e-6))
        target = torch.clamp(target, min=k_min, max=k_max)
        return (target.to(torch.int64) - k_min).to(torch.int64)

    tracker = Tracker()
    mode = TrackingFakeTensorMode(tracker)
    with real_path(mode), mode:
        one = levels(5, 5)
        four = levels(2, 5)
        sizes = [len(torch.where(one == level)[0]) for level in (0, 1)]
        sizes += [len(torch.where(four == level)[0]) for level in (0, 3, 4)]
        moved = torch.randint(0, 3, (10,)).clamp(0, 2).add(3, alpha=2)
    assert sizes == [50, 0, 50, 50, 0]
    sets = [values_in(t, real_value) for t in (one, four, moved)]
    assert [None if v is None else v.tolist() for v in sets] == [[0], [0, 1, 2, 3], [6, 7, 8]]


def test_a_write_through_an_alias_voids_what_was_known() -> None:
    mode = TrackingFakeTensorMode(Tracker())
    with real_path(mode), mode:
        picked = torch.arange(4)[torch.randint(0, 4, (10,))]  # values in 0..3
        alias = picked.view(2, 5)
        known_before = values_in(picked, real_value)
        alias[0, torch.randint(0, 5, (2,))] = 9  # written through the view
    assert known_before is not None and known_before.tolist() == [0, 1, 2, 3]
    assert values_in(picked, real_value) is None


def _faster_rcnn_case() -> tuple[nn.Module, Any, Callable[[nn.Module, Any], Tensor]]:
    # The smallest Faster R-CNN whose RoI sampler matters: 96x128 images give ~420 proposals per image,
    # of which the sampler keeps 128.
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn

    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=3,
        min_size=96,
        max_size=128,
        box_batch_size_per_image=128,
        rpn_batch_size_per_image=64,
    ).train()
    images = [torch.rand(3, 96, 128) for _ in range(2)]
    targets = [
        {
            "boxes": torch.tensor([[10.0, 20.0, 60.0, 90.0], [40.0, 30.0, 120.0, 95.0]]),
            "labels": torch.tensor([1, 2]),
        },
        {"boxes": torch.tensor([[5.0, 5.0, 50.0, 70.0]]), "labels": torch.tensor([1])},
    ]

    def loss_fn(m: nn.Module, batch: Any) -> Tensor:
        losses = m(*batch)
        return sum(losses.values())  # type: ignore[no-any-return]

    return model, (images, targets), loss_fn


def test_faster_rcnn_samples_its_rois_and_is_exact() -> None:
    # Issue 13: without the bounds the estimate pooled every proposal (+93 % at 128x160).
    model, batch, loss_fn = _faster_rcnn_case()
    est = estimate_step(model, batch, loss_fn=loss_fn, optimizer=torch.optim.SGD, calibrate=True)
    reads = _reads(est)
    assert set(reads["aten.nonzero.default"]) >= {
        "128 of 422 nonzero (the most the ops that made it allow)",  # RoI heads: 128 per image
        "64 of 840 nonzero (the most the ops that made it allow)",  # RPN: 32 + 32 of 64 per image
        "0 of 256 nonzero (the most the ops that made it allow)",  # no RoI on the second FPN level
    }
    real = measure_step(copy.deepcopy(model), batch, StepConfig(loss_fn=loss_fn, optimizer=torch.optim.SGD))
    for estimated, measured in (
        (est.first_step.bytes, real.first_step),
        (est.steady_state.bytes, real.steady_state),
    ):
        assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)


def test_stopping_logic_carries_values_and_reads_them() -> None:
    # A generation loop's "finished?" (transformers' _sample): unknown until the maximum length, then
    # known through ``full(True) | x``, ``~``, ``x & False``, ``max`` and ``== 0`` -- also of tensors too
    # large to have known values (more than real_path.VALUE_LIMIT elements).
    tracker = Tracker()
    mode = TrackingFakeTensorMode(tracker)
    with real_path(mode), mode:
        tokens = torch.randint(0, 100, (4,))  # unknown values
        unfinished = torch.ones(4, dtype=torch.long)
        answers = []
        for done in (False, True):
            is_done = torch.full((4,), done) | torch.isin(tokens, torch.tensor([7]))
            unfinished = unfinished & ~is_done
            answers.append(bool(unfinished.max() == 0))
        big = torch.full((1 << 21,), True) | (torch.randint(0, 9, (1 << 21,)) == 3)
        big_sets = [values_in(t, real_value) for t in (big, ~big, big.any(), big.all(), (~big).long().amax())]
        answers += [bool(big.all()), int((~big).long().sum()), int(torch.where(big[:4], 3, tokens).max())]
    assert answers == [False, True, True, 0, 3]
    assert [None if s is None else s.tolist() for s in big_sets] == [[True], [False], [True], [True], [0]]
    assumed = [e.assumed for e in tracker.events if isinstance(e, DataDependent)]
    assert assumed == [
        "False (assumed: an unknown value equals no given value)",
        "True (the only value it can hold)",
        "True (the only value it can hold)",
        "0 (the only value it can hold)",
        "3 (the only value it can hold)",
    ]


def test_reads_of_comparisons_assume_no_coincidence() -> None:
    # An unknown value equals no given value: ``==`` and ``isin`` read False, ``!=`` True, through
    # ``~``, ``any``/``all`` and ``&``/``|``; reads of anything else stay neutral (but the NaN check).
    tracker = Tracker()
    mode = TrackingFakeTensorMode(tracker)
    with real_path(mode), mode:
        tokens = torch.randint(0, 100, (4,))
        answers = [
            bool((tokens == 5).any()),
            bool((tokens != 5).all()),
            bool(~torch.isin(tokens, torch.tensor([5, 6])).any()),
            bool(torch.isin(tokens, torch.tensor([5]), invert=True).all() & (tokens != 2).all()),
            bool((tokens > 5).any()),  # no comparison with a given value: neutral
            bool((tokens != tokens).any()),  # a value equals itself (a NaN check): no NaN in a healthy run
        ]
    assert answers == [False, True, True, True, False, False]
    assumed = [
        e.assumed.split(" (")[0] + (" assumed" if "assumed" in e.assumed else "")
        for e in tracker.events
        if isinstance(e, DataDependent)
    ]
    expected = ["False assumed", "True assumed", "True assumed", "True assumed", "False", "False assumed"]
    assert assumed == expected


def test_checks_that_only_validate_read_as_a_healthy_run_reads_them() -> None:
    # What a run that does not crash has: no NaN, no infinity, validations that hold. Each check of
    # a loss that pytorch-forecasting asserts, torch.distributions' argument validation (on by
    # default), and the reason each says in the report.
    tracker = Tracker()
    mode = TrackingFakeTensorMode(tracker)
    with real_path(mode), mode:
        loss = torch.randn(8).square().mean()
        answers = [
            bool(torch.isnan(loss)),
            bool(torch.isinf(loss)),
            bool(torch.isfinite(loss)),
            bool(torch.isfinite(torch.randn(4)).all()),
            bool(torch.isposinf(loss) | torch.isneginf(loss)),
            bool(torch._is_all_true(torch.randn(4) > 0)),
        ]
        torch.distributions.Normal(torch.randn(4), torch.randn(4).exp())  # validate_args: on
        torch.distributions.Categorical(logits=torch.randn(4, 3)).log_prob(torch.randint(0, 3, (4,)))
    assert answers == [False, False, True, True, False, True]
    reasons = [e.assumed for e in tracker.events if isinstance(e, DataDependent)]
    finite, valid = "a healthy run's values are finite", "the library's check passes"
    assert all(finite in r for r in reasons[:5]) and valid in reasons[5], reasons
    # The distributions were built and sampled from without raising: what they read passed.
    assert all(valid in r or finite in r or "real value" in r for r in reasons[6:]), reasons


def test_elementwise_ops_combine_value_sets() -> None:
    mode = TrackingFakeTensorMode(Tracker())
    with real_path(mode), mode:
        levels = torch.arange(3)[torch.randint(0, 3, (50,))]  # values in 0..2, unknown which
        flags = torch.arange(2).bool()[torch.randint(0, 2, (50,))]  # False or True
        found = {
            "sum": levels + levels * 10,
            "rsub": 1 - levels,
            "and": levels & 1,
            "absorbed": levels * torch.zeros(50, dtype=torch.long),
            "eq": levels == 1,
            "not": ~flags,
            "where": torch.where(flags, levels, 7),
            "mod": levels % 2,
        }
        unknown = torch.randint(0, 9, (50,))
        none = {"unknown": unknown + levels, "by zero": levels // levels}
    sets = {k: values_in(t, real_value) for k, t in found.items()}
    assert {k: None if v is None else v.tolist() for k, v in sets.items()} == {
        "sum": [0, 1, 2, 10, 11, 12, 20, 21, 22],  # every combination: a superset
        "rsub": [-1, 0, 1],
        "and": [0, 1],
        "absorbed": [0],
        "eq": [False, True],
        "not": [False, True],
        "where": [0, 1, 2, 7],
        "mod": [0, 1],
    }
    assert all(values_in(t, real_value) is None for t in none.values())


def test_sets_of_known_values_are_worked_out_once() -> None:
    # Views of one known mask ask for its set op after op: one ``unique`` each storage write, and none
    # at all for tensors too large to keep a set of.
    mode = TrackingFakeTensorMode(Tracker())
    with real_path(mode), mode:
        mask = torch.ones(4, 1000, dtype=torch.long)
        first = values_in(mask, real_value)
        cached = values_in(mask, real_value)
        mask.add_(1)  # a write: the cached set is void
        again = values_in(mask, real_value)
    assert first is not None and first.tolist() == [1]
    assert cached is first
    assert again is not None and again.tolist() == [2]


def test_a_routers_selections_share_its_picks_evenly() -> None:
    # Each of 1000 tokens picks 2 of 6 experts (topk) or 1 (argmax); `ids == e` per expert shares the
    # picks: in any order the shares add up to every pick, each at most its own bound; the same
    # expert selected again gets the same share; a picked value outside the experts gets none.
    tracker = Tracker()
    mode = TrackingFakeTensorMode(tracker)
    with real_path(mode), mode:
        logits = torch.randn(1000, 6)
        ids = logits.topk(2, dim=-1).indices
        top2 = [len(torch.where(ids == e)[0]) for e in (5, 0, 3, 1, 2, 4)]
        again = len(torch.where(ids == 0)[0])
        flat = ids.view(-1)  # views of the picks are picks too
        flat_shares = [int(torch.nonzero(flat == e).shape[0]) for e in range(6)]
        best = logits.argmax(-1)
        top1 = [len(torch.where(best == e)[0]) for e in range(6)]
        none = len(torch.where(ids == 6)[0])
        other = torch.randint(0, 6, (1000,))  # unknown values, not picks: each selection its bound
        unpicked = [len(torch.where(other == e)[0]) for e in range(1, 3)]
    assert sum(top2) == 2000 and max(top2) - min(top2) <= 1, top2
    assert again == top2[1]
    assert sum(flat_shares) == 2000 and sum(top1) == 1000 and max(top1) - min(top1) <= 1, (flat_shares, top1)
    assert none == 0
    assert unpicked == [1000, 1000]
    reads = [e.assumed for e in tracker.events if isinstance(e, DataDependent) and "even share" in e.assumed]
    assert reads[0] == "334 of 2000 nonzero (an even share of 6 values selected apart)", reads[0]
