"""The engine's guarantees: the user's model is left exactly as it was, any input form is accepted,
data-dependent reads follow the documented policy, and failures name the op and module."""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.transformer import Transformer
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memest import EstimationError, estimate_step
from lightning_memest.engine.step import first_output


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class CachingEncoding(nn.Module):
    """Caches a tensor on itself during the first forward, like Lightning's demo PositionalEncoding."""

    def __init__(self) -> None:
        super().__init__()
        self.pe: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.pe is None or self.pe.shape != x.shape[1:]:
            self.pe = torch.arange(x[0].numel(), dtype=x.dtype, device=x.device).reshape(x.shape[1:]) / 100
        return x + self.pe


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = CachingEncoding()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(32, 4)
        self.register_buffer("scale", torch.ones(4))
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(self.enc(self.frozen(x)))) * self.scale  # type: ignore[no-any-return]


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "tensors": {
            id(m): {k: v for k, v in vars(m).items() if isinstance(v, Tensor)} for m in model.modules()
        },
        "attrs": {id(m): set(vars(m)) for m in model.modules()},
        "params": {n: (p, p.requires_grad, p.grad) for n, p in model.named_parameters()},
        "buffers": {n: b for n, b in model.named_buffers()},
        "training": {id(m): m.training for m in model.modules()},
    }


def test_model_is_left_exactly_as_it_was() -> None:
    torch.manual_seed(0)
    model = Net()
    model(torch.randn(3, 16)).sum().backward()  # real grads and a cached real `pe` exist
    model.body[0].eval()  # mixed training flags must survive
    batch = torch.randn(8, 16)
    before = snapshot(model)
    rng = torch.get_rng_state()

    estimate_step(model, batch, optimizer=torch.optim.Adam)  # Dropout draws random numbers

    after = snapshot(model)
    assert torch.equal(rng, torch.get_rng_state())
    assert after["attrs"] == before["attrs"]
    assert after["training"] == before["training"]
    for name, (p, requires_grad, grad) in before["params"].items():
        q, q_requires_grad, q_grad = after["params"][name]
        assert q is p and q_requires_grad == requires_grad and q_grad is grad
    assert all(after["buffers"][n] is b for n, b in before["buffers"].items())
    for key, tensors in before["tensors"].items():
        assert after["tensors"][key].keys() == tensors.keys()
        assert all(after["tensors"][key][k] is v for k, v in tensors.items())
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k
    # and it still trains for real
    model(torch.randn(8, 16)).sum().backward()


def test_lazily_cached_tensor_does_not_leak_into_real_training() -> None:
    model = Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=1)
    tokens = torch.randint(0, 50, (2, 8))
    assert getattr(model.pos_encoder, "pe", None) is None or not hasattr(model.pos_encoder.pe, "fake_mode")
    estimate_step(model, (tokens, tokens), loss_fn=lambda m, b: m(*b).sum(), optimizer=sgd)
    out = model(tokens, tokens)  # would fail if a fake `pe` had been left behind
    assert type(out) is Tensor and torch.isfinite(out).all()


def test_meta_real_and_fake_models_give_the_same_estimate() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))

    torch.manual_seed(0)
    real = build()
    with torch.device("meta"):
        meta = build()
    batch = torch.randn(16, 64)
    a = estimate_step(real, batch, optimizer=torch.optim.AdamW)
    b = estimate_step(meta, batch.to("meta"), optimizer=torch.optim.AdamW)
    mode = FakeTensorMode()
    fake = copy.deepcopy(real)
    for m in fake.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = nn.Parameter(mode.from_tensor(p.detach()))
    c = estimate_step(fake, mode.from_tensor(batch), optimizer=torch.optim.AdamW)
    assert [p.bytes for p in a.peaks] == [p.bytes for p in b.peaks] == [p.bytes for p in c.peaks]
    assert a.device == b.device == c.device == "cpu"


def test_nested_batches() -> None:
    class DictModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 4)
            self.b = nn.Linear(6, 4)

        def forward(self, x: Tensor, extra: dict[str, Any]) -> Tensor:
            return self.a(x) + self.b(extra["y"][0]) * extra["scale"]  # type: ignore[no-any-return]

    batch = {"x": torch.randn(5, 8), "extra": {"y": [torch.randn(5, 6)], "scale": 2.0}}
    est = estimate_step(DictModel(), batch, optimizer=sgd)
    assert est.first_step.breakdown.inputs == (5 * 8 + 5 * 6) * 4


def test_breakdown_of_a_hand_computed_step() -> None:
    # Linear 256 -> 512 with bias, batch 64, SGD with momentum, sum loss.
    model = nn.Linear(256, 512)
    est = estimate_step(model, torch.randn(64, 256), optimizer=sgd)
    params = (256 * 512 + 512) * 4
    step2 = est.steady_state.breakdown
    assert step2.parameters == params
    assert step2.inputs == 64 * 256 * 4
    assert step2.optimizer_state == params  # one momentum buffer per parameter
    assert est.steady_state.bytes == est.steady_state.breakdown.total
    # the module tree knows the parameters
    assert est.modules.parameter_bytes == params
    assert est.modules.children is None


def test_true_precision_converts_the_fake_copy_only() -> None:
    model = nn.Linear(128, 128)
    est = estimate_step(model, torch.randn(4, 128), optimizer=sgd, precision="bf16-true")
    assert est.first_step.breakdown.parameters == (128 * 128 + 128) * 2
    assert est.first_step.breakdown.inputs == 4 * 128 * 2
    assert model.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="precision must be one of"):
        estimate_step(model, torch.randn(4, 128), precision="bf16")


def test_item_bool_and_transformer_mask_check_follow_the_policy() -> None:
    model = Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=1)
    tokens = torch.randint(0, 50, (2, 8))
    logged: list[float] = []

    def loss_fn(m: nn.Module, batch: Any) -> Tensor:
        out = m(*batch)
        loss = F.nll_loss(out, batch[1].reshape(-1))
        logged.append(loss.item())  # logging reads a value
        if torch.isnan(loss):  # a guard reads one too
            raise AssertionError("a healthy run's loss is no NaN")
        return loss

    est = estimate_step(model, (tokens, tokens), loss_fn=loss_fn, optimizer=sgd)
    assert logged == [0.0, 0.0]
    reads = est.data_dependent
    assert reads is not None
    assumed = {(r.op, r.assumed) for r in reads}
    assert ("aten._local_scalar_dense.default", "0.0") in assumed
    finite = "False (assumed: a healthy run's values are finite)"
    assert ("aten._local_scalar_dense.default", finite) in assumed
    # nn.Transformer's causal-mask detection is located in the decoder
    assert any(r.module.startswith("transformer") for r in reads)


def test_data_dependent_shapes_assume_every_element_selected() -> None:
    class Masky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)

        def forward(self, x: Tensor) -> Tensor:
            h = self.inner(x)
            return h[h > 0].sum() + torch.nonzero(h > 0.5).sum() + torch.masked_select(h, h < 0).sum()  # type: ignore[no-any-return]

    est = estimate_step(Masky(), torch.randn(4, 8), optimizer=sgd)
    assert est.data_dependent is not None
    ops = {r.op: r for r in est.data_dependent}
    assert ops["aten.index.Tensor"].assumed == "every element of the mask set (32)"
    assert ops["aten.nonzero.default"].assumed == "every element nonzero (32 of 32)"
    assert ops["aten.masked_select.default"].count == 2  # once per simulated step


def test_errors_in_user_code_are_estimation_errors() -> None:
    def bad_loss(m: nn.Module, batch: Tensor) -> Tensor:
        raise KeyError("labels")

    with pytest.raises(EstimationError, match="KeyError"):
        estimate_step(nn.Linear(2, 2), torch.randn(1, 2), loss_fn=bad_loss)


def test_no_real_allocation_grows_with_model_or_batch() -> None:
    # Ground truth from the profiler's allocator events, not from the estimator's bookkeeping.
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB of weights
    batch = torch.randn(256, 1024)
    estimate_step(model, batch, optimizer=torch.optim.Adam)  # warm caches up
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        estimate_step(model, batch, optimizer=torch.optim.Adam)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    allocated = sum(e.nbytes() for e in events if e.nbytes() > 0)
    assert allocated < 1 << 20, allocated  # the real step would allocate hundreds of MiB


def test_module_tree_and_timeline() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    est = estimate_step(model, torch.randn(16, 32), optimizer=torch.optim.Adam)
    tree = {m.path: m for m in est.modules.walk()}
    assert set(tree) == {"", "0", "1", "2"}
    assert tree["0"].parameter_bytes == (32 * 64 + 64) * 4
    assert tree["1"].saved_bytes == 16 * 64 * 4  # ReLU saves its output
    assert tree[""].saved_bytes == sum(tree[p].saved_bytes for p in ("0", "1", "2"))
    assert all(tree[p].backward_peak_bytes is not None for p in ("0", "1", "2"))
    phases = {t.phase.value for t in est.timeline}
    assert {"forward", "backward", "optimizer"} <= phases
    assert max(t.live_bytes for t in est.timeline if t.step == 1) == est.first_step.bytes
    assert [t.op_index for t in est.timeline] == sorted(t.op_index for t in est.timeline)


def test_first_output_rules() -> None:
    t = torch.ones(1)
    assert first_output((t, 1)) is t
    assert first_output({"loss": 1.0, "logits": t}) is t
    assert first_output({"a": 1, "b": t}) is t

    class Out:
        logits = t

    assert first_output(Out()) is t
    with pytest.raises(TypeError):
        first_output(3)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_runs_under_autocast(precision: str) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    full = estimate_step(model, torch.randn(32, 64), optimizer=sgd)
    mixed = estimate_step(model, torch.randn(32, 64), optimizer=sgd, precision=precision)
    relu = {m.path: m for m in mixed.modules.walk()}["1"]
    # under autocast the first Linear's output, which ReLU saves, is half precision
    assert relu.saved_bytes == 32 * 64 * 2
    assert {m.path: m for m in full.modules.walk()}["1"].saved_bytes == 32 * 64 * 4
    assert math.isclose(mixed.first_step.breakdown.parameters, full.first_step.breakdown.parameters)


def test_activation_checkpointing_matches_the_real_step() -> None:
    # Hooks on tensors (register_multi_grad_hook) kept checkpointed blocks' inputs alive: +1.1 %.
    from torch.utils.checkpoint import checkpoint

    from lightning_memest.engine.step import StepConfig
    from lightning_memest.measure import measure_step

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))

        def forward(self, x: Tensor) -> Tensor:
            return x + self.f(x)  # type: ignore[no-any-return]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(4)])

        def forward(self, x: Tensor) -> Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x

    torch.manual_seed(0)
    model, batch = Net(), torch.randn(256, 128)
    est = estimate_step(model, batch, optimizer=torch.optim.AdamW)
    real = measure_step(copy.deepcopy(model), batch, StepConfig(optimizer=torch.optim.AdamW))
    for peak, truth in zip(est.peaks, real.peak_bytes, strict=True):
        assert abs(peak.bytes - truth) / truth < 0.001, (peak.bytes, truth)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_peak_bytes_without_the_report_is_the_reported_peak(device: str) -> None:
    from lightning_memest.accounting import capture_filter, peak_bytes
    from lightning_memest.engine.simulate import simulate
    from lightning_memest.engine.step import StepConfig

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("the what-if is for machines without a GPU")
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10)
    )
    batch = torch.randn(4, 3, 16, 16)
    est = estimate_step(model, batch, optimizer=torch.optim.AdamW, device=device)
    config = StepConfig(optimizer=torch.optim.AdamW)
    sim = simulate(model, batch, config, device=device, capture=capture_filter(flops=False))
    assert peak_bytes(sim) == est.peak_bytes


def test_each_step_its_own_batch_against_the_real_steps() -> None:
    # Dynamic padding: the second batch is longer. The estimate runs each step on its own batch (the
    # first one gone), measured against real steps on the same batches (the CPU allocator's events;
    # each step's resident tensors counted at its start, as the callback's probe does).
    from lightning_memest.engine.step import StepConfig, StepRunner
    from lightning_memest.measure import StepProbe, module_tensors

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(100, 32), nn.Linear(64, 5)
            self.rnn = nn.GRU(32, 64, batch_first=True)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(self.embed(ids))[0])  # type: ignore[no-any-return]

    torch.manual_seed(0)
    model = Tagger()
    short, long = torch.randint(0, 100, (4, 12)), torch.randint(0, 100, (4, 48))
    est = estimate_step(model, short, optimizer=torch.optim.Adam, next_batches=[long], calibrate=True)
    assert est.batch_shapes == (((4, 12),), ((4, 48),))
    same = estimate_step(model, short, optimizer=torch.optim.Adam)
    assert est.steady_state.bytes > same.steady_state.bytes  # the longer batch needs more

    real = copy.deepcopy(model)
    runner = StepRunner(real, StepConfig(optimizer=torch.optim.Adam))
    probe = StepProbe(torch.device("cpu"))
    for batch in (short, long):
        state = [t for s in (runner.optimizer.state.values() if runner.optimizer else ()) for t in s.values()]
        probe.start([*module_tensors(real), *state, batch])
        loss = runner.run(batch)
        del loss
        probe.stop()
    measured = [peak for peak, _ in probe.finish()]
    assert [p.bytes for p in est.peaks] == measured


def test_parameters_made_the_older_torch_way_give_the_same_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.11-2.13's FakeTensor constructor takes no requires_grad/_is_param: the conversion then
    # wraps the fake in nn.Parameter, which must give the same figures.
    from lightning_memest.engine import fake
    from tests.models import TinyGPT

    model, batch = TinyGPT(), torch.randint(0, 100, (2, 16))
    fast = estimate_step(model, batch, optimizer=torch.optim.AdamW)
    monkeypatch.setattr(fake, "_PARAM_FAKES", False)
    plain = estimate_step(model, batch, optimizer=torch.optim.AdamW)
    assert plain.peaks == fast.peaks and plain.modules == fast.modules


@pytest.mark.skipif(
    sys.version_info >= (3, 14), reason="Python 3.14's incremental collector has no full collection to pause"
)
def test_full_collections_wait_and_the_collector_is_put_back() -> None:
    # A full collection walks every object of the process; inside a simulation only the young
    # generations are collected. Without the pause the same allocations do bring a full one.
    import gc

    from lightning_memest.engine.collector import full_collections_paused

    def generations_collected(paused: bool) -> set[int]:
        seen: set[int] = set()

        def note(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                seen.add(info["generation"])

        gc.collect()
        kept: list[list[Any]] = []
        gc.callbacks.append(note)
        try:
            with full_collections_paused() if paused else contextlib.nullcontext():
                for _ in range(len(gc.get_objects()) // 2 + 50_000):  # well past a quarter of the heap
                    cycle: list[Any] = []
                    cycle.append(cycle)
                    kept.append(cycle)
        finally:
            gc.callbacks.remove(note)
        return seen

    before = gc.get_threshold()
    assert 2 in generations_collected(paused=False)
    assert generations_collected(paused=True) == {0, 1}
    assert gc.get_threshold() == before

    def failing_step(model: nn.Module, batch: Tensor) -> Tensor:
        raise RuntimeError("a user's bug")

    with pytest.raises(EstimationError):
        estimate_step(nn.Linear(4, 4), torch.randn(2, 4), loss_fn=failing_step)
    assert gc.get_threshold() == before and gc.isenabled()


def test_the_steps_run_with_the_collector_off_as_a_measurement_does() -> None:
    # A collection in the middle of a simulated step (they fall due at the simulation's own
    # allocation counts, not the run's) kept two activations of FSDP2 with compiled blocks alive past
    # their last use: +2.0 % (benchmarks/distributed.py, against real gloo ranks measured with the
    # collector off). The steps run without one; the collector is back on after, on every way out.
    import gc

    seen: list[bool] = []

    def loss(model: nn.Module, batch: Tensor) -> Tensor:
        seen.append(gc.isenabled())
        out: Tensor = model(batch).sum()
        return out

    estimate_step(nn.Linear(4, 4), torch.randn(2, 4), loss_fn=loss)
    assert seen and not any(seen) and gc.isenabled()

    def failing_step(model: nn.Module, batch: Tensor) -> Tensor:
        raise RuntimeError("a user's bug")

    with pytest.raises(EstimationError):
        estimate_step(nn.Linear(4, 4), torch.randn(2, 4), loss_fn=failing_step)
    assert gc.isenabled()


class CholeskySolve(nn.Module):
    """A Cholesky factor and a triangular solve: the backward of ``linalg_cholesky_ex`` sums in its
    own formula (``gA + gA.tril(-1).mH()``), a sum autograd's engine does not make in place."""

    def __init__(self, n: int = 300) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n) / n**0.5)

    def forward(self, x: Tensor) -> Tensor:
        a = self.w @ self.w.mT + 4 * torch.eye(len(self.w))
        factor, _ = torch.linalg.cholesky_ex(a)
        return torch.linalg.solve_triangular(factor, x, upper=False).sum()


def test_a_sum_inside_a_backward_formula_allocates_as_the_real_one() -> None:
    # Counted as an in-place accumulation before, one n x n matrix low (-12 % of an exact GP's peak).
    from lightning_memest.engine.step import StepConfig
    from lightning_memest.measure import measure_step

    torch.manual_seed(0)
    x = torch.randn(300, 4)
    est = estimate_step(CholeskySolve(), x, loss_fn=lambda m, b: m(b))
    real = measure_step(CholeskySolve(), x, StepConfig(loss_fn=lambda m, b: m(b)))
    for e, m in ((est.first_step.bytes, real.first_step), (est.steady_state.bytes, real.steady_state)):
        assert abs(e - m) <= 0.01 * m, (e, m)
