"""The node-level profile (lightning_memest/fx.py): node figures add up to the engine's module-level
figures of the same step (saved activations, FLOPs), single nodes save what their backward needs, the
graph is annotated, and an untraceable model raises TraceError."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torchvision
from models import TinyGPT, lm_batch, lm_loss
from torch import Tensor, nn

from lightning_memest import estimate_step
from lightning_memest.engine.step import LossFn, sum_loss
from lightning_memest.errors import MemestError, TraceError
from lightning_memest.fx import (
    META_KEY,
    GraphProfile,
    NodeProfile,
    annotate,
    annotated_graph_module,
    profile_graph,
    trace,
)
from lightning_memest.report.tables import module_rows, module_table

F32 = 4  # bytes per float32 element


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


CASES: dict[str, tuple[Any, Any, LossFn]] = {
    "resnet18": (lambda: torchvision.models.resnet18(), lambda: torch.randn(2, 3, 32, 32), sum_loss),
    "mobilenet_v2": (lambda: torchvision.models.mobilenet_v2(), lambda: torch.randn(1, 3, 64, 64), sum_loss),
    "tiny_gpt": (
        lambda: TinyGPT(n_layers=2, d_model=32, n_heads=2, vocab=50, seq_len=16),
        lambda: lm_batch(2, 16, vocab=50),
        lm_loss,
    ),
    "mlp": (mlp, lambda: torch.randn(4, 32), sum_loss),
}


@pytest.mark.parametrize("name", list(CASES))
def test_nodes_add_up_to_the_engine_totals(name: str) -> None:
    """Saved bytes (each storage once) and FLOPs of the nodes, plus what ran outside the graph, are the
    step's activation total and FLOP totals of estimate_step (the module-level report)."""
    make_model, make_batch, loss_fn = CASES[name]
    torch.manual_seed(0)
    model, batch = make_model(), make_batch()
    profile = profile_graph(model, batch, loss_fn=loss_fn)
    est = estimate_step(model, batch, loss_fn=loss_fn, steps=1)
    engine_saved = est.modules.saved_bytes
    assert engine_saved > 0
    assert profile.totals.saved_bytes == pytest.approx(engine_saved, rel=0.01)
    assert est.flops is not None
    totals = profile.totals
    assert (totals.fwd_flops, totals.bwd_flops) == (est.flops.forward, est.flops.backward)
    assert (totals.fwd_other_flops, totals.bwd_other_flops) == (
        est.flops.other_forward,
        est.flops.other_backward,
    )
    # Every graph node is profiled, in graph order; the loss is outside the graph.
    assert [n.name for n in profile.nodes] == [n.name for n in profile.graph_module.graph.nodes]
    if loss_fn is lm_loss:  # log_softmax saves its output, outside the graph
        assert profile.outside.fwd_tmp > 0
    else:
        assert profile.outside.saved == 0


def test_the_model_is_left_as_it_was() -> None:
    model = mlp()
    before = {n: (p, p.data.clone()) for n, p in model.named_parameters()}
    gm = torch.fx.symbolic_trace(model)
    profile = profile_graph(gm, torch.randn(4, 32))
    assert profile.graph_module is gm
    assert "forward" not in vars(gm)  # the interpreter's forward is gone
    assert all(META_KEY not in n.meta for n in gm.graph.nodes)  # annotating is explicit
    for name, p in model.named_parameters():
        assert p is before[name][0] and p.grad is None and torch.equal(p.data, before[name][1])
    torch.testing.assert_close(gm(torch.ones(1, 32)), model(torch.ones(1, 32)))


# ------------------------------------------------------------------------------------ single nodes


def test_relu_saves_its_output_and_linear_its_input() -> None:
    # Linear(32, 64) -> ReLU -> Linear(64, 64) -> Tanh -> Linear(64, 10), batch 4
    p = profile_graph(mlp(), torch.randn(4, 32))
    hidden = 4 * 64 * F32
    first, relu, second, tanh, last = (p.node(f"_{i}") for i in range(5))
    # The first Linear's input is the batch (resident, not an activation); it saves nothing.
    assert (first.fwd_in, first.fwd_tmp, first.fwd_out) == (0, 0, hidden)
    # ReLU and Tanh save their outputs (threshold_backward / tanh_backward read them): created there.
    assert (relu.fwd_in, relu.fwd_tmp, relu.fwd_out) == (0, hidden, hidden)
    assert (tanh.fwd_in, tanh.fwd_tmp) == (0, hidden)
    # The next Linear saves the same storage (its input): counted once, for the first saver.
    assert second.saved == 0 and last.saved == 0
    # Backward: the last Linear hands on the gradient of its input and keeps its parameters' gradients.
    assert last.bwd_out == 4 * 64 * F32 + (64 * 10 + 10) * F32
    assert first.bwd_out == (32 * 64 + 64) * F32  # no input gradient: the batch needs none
    assert p.totals.saved_bytes == 2 * hidden


def test_linear_and_conv_save_their_inputs() -> None:
    linear = profile_graph(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), torch.randn(2, 8))
    assert (linear.node("_1").fwd_in, linear.node("_1").fwd_tmp) == (2 * 16 * F32, 0)
    conv = profile_graph(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)), torch.randn(1, 3, 8, 8))
    assert (conv.node("_1").fwd_in, conv.node("_1").fwd_tmp) == (4 * 6 * 6 * F32, 0)
    assert conv.node("_0").fwd_out == 4 * 6 * 6 * F32
    assert conv.node("_0").saved == 0  # its input is the batch


def test_views_and_in_place_ops_allocate_no_output() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: Tensor) -> Tensor:
            y = self.fc(x).view(2, 4, 2)
            return torch.relu_(y).flatten(1)

    p = profile_graph(Net(), torch.randn(2, 8))
    by_op = {n.target: n for n in p.nodes}
    assert by_op["fc"].fwd_out == 2 * 8 * F32
    assert by_op["view"].fwd_out == 0 and by_op["flatten"].fwd_out == 0
    relu = by_op["torch.relu_"]
    # relu_ saves its result, the fc output's storage, which existed before it ran: a saved input.
    assert (relu.fwd_in, relu.fwd_tmp, relu.fwd_out) == (2 * 8 * F32, 0, 0)


def test_node_flops() -> None:
    p = profile_graph(nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4)), torch.randn(3, 16))
    first, second = p.node("_0"), p.node("_1")
    assert first.fwd_flops == 2 * 3 * 16 * 8
    assert first.bwd_flops == 2 * 3 * 16 * 8  # the weight's gradient only (the batch needs none)
    assert second.fwd_flops == 2 * 3 * 8 * 4
    assert second.bwd_flops == 2 * (2 * 3 * 8 * 4)  # the input's and the weight's gradients
    assert first.fwd_other_flops == 0  # addmm: the bias add is part of the product


def test_mixed_precision_and_keyword_inputs() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: Tensor, y: Tensor | None = None) -> Tensor:
            out: Tensor = self.a(x) * self.b(y)
            return out

    model = TwoInputs()
    batch = {"x": torch.randn(2, 8), "y": torch.randn(2, 8)}
    for precision in ("32-true", "bf16-mixed"):
        p = profile_graph(model, batch, precision=precision)
        est = estimate_step(model, batch, precision=precision, steps=1)
        assert p.totals.saved_bytes == est.modules.saved_bytes > 0
        assert p.precision == precision


# ------------------------------------------------------------------------------------ errors


class DataDependentBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.fc(x)
        if y.sum() > 0:
            return y.relu()
        return -y


def test_an_untraceable_model_raises_trace_error() -> None:
    model = DataDependentBranch()
    with pytest.raises(TraceError, match=r"DataDependentBranch.*control flow") as info:
        profile_graph(model, torch.randn(2, 4))
    assert isinstance(info.value, MemestError)
    with pytest.raises(TraceError):
        trace(model)
    # The module-level estimate needs no trace.
    assert estimate_step(model, torch.randn(2, 4), steps=1).modules.saved_bytes >= 0


def test_bad_arguments() -> None:
    p = profile_graph(nn.Linear(4, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="by must be one of"):
        p.table(by="nope")
    with pytest.raises(ValueError, match="top"):
        p.rows(top=-1)
    with pytest.raises(ValueError, match="precision"):
        profile_graph(nn.Linear(4, 4), torch.randn(2, 4), precision="fp8")


# ------------------------------------------------------------------------------------ output


def test_annotated_graph_module() -> None:
    gm = annotated_graph_module(mlp(), torch.randn(4, 32))
    profiles = [n.meta[META_KEY] for n in gm.graph.nodes]
    assert all(isinstance(x, NodeProfile) for x in profiles)
    assert [x.name for x in profiles] == [n.name for n in gm.graph.nodes]
    relu = next(n for n in gm.graph.nodes if n.target == "1")
    assert relu.meta[META_KEY].fwd_tmp == 4 * 64 * F32
    # annotate() puts a profile on another copy of the graph, by node name.
    other = torch.fx.symbolic_trace(mlp())
    p = profile_graph(mlp(), torch.randn(4, 32))
    assert annotate(other, p) is other
    assert [n.meta[META_KEY] for n in other.graph.nodes] == list(p.nodes)


def test_rows_table_and_json() -> None:
    p = profile_graph(mlp(), torch.randn(4, 32))
    assert isinstance(p, GraphProfile)
    rows = p.rows(by="saved", top=2)
    assert [r["name"] for r in rows] == ["_1", "_3"]  # the ReLU and the Tanh: ties keep graph order
    assert rows[0]["saved"] == rows[0]["fwd_in"] + rows[0]["fwd_tmp"]
    data = json.loads(json.dumps(p.to_json()))
    assert data["totals"]["saved_bytes"] == p.totals.saved_bytes
    assert len(data["nodes"]) == len(p.nodes)
    assert data["outside"]["name"] == "(outside)"
    table = p.table()
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["node", "op", "target", "fwd_in", "fwd_tmp"]
    assert len(lines) == 1 + len(p.nodes) + 2  # header, nodes, outside, total
    assert lines[-1].startswith("total")
    assert "2.00 KiB" in table  # 4 x 128 x 4 B in the saved column of the total
    assert len(p.table(top=3, by="flops").splitlines()) == 1 + 3 + 2


def test_module_rows_and_table() -> None:
    est = estimate_step(mlp(), torch.randn(4, 32), steps=1)
    rows = module_rows(est.modules, by="saved", top=3)
    assert [r["path"] for r in rows] == ["", "1", "3"]
    assert "children" not in rows[0]
    leaves = module_rows(est.modules, leaves_only=True)
    assert [r["path"] for r in leaves] == ["0", "1", "2", "3", "4"]
    table = module_table(est.modules, by="flops", top=2)
    assert table.splitlines()[1].startswith("(root)")
    with pytest.raises(ValueError, match="by must be one of"):
        module_rows(est.modules, by="graph")
