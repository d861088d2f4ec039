"""The simulation takes a real eager run's code path: libraries that look for tracing (transformers'
masking utilities) see what a real run sees, and the values they read are the real ones. Checked
against the CPU allocator's events of a real step (``measure_step``: an independent mechanism) on
Llama/Mistral-style causal LMs with grouped-query attention and SDPA."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memest import estimate_step
from lightning_memest.engine.real_path import known_value, real_path
from lightning_memest.engine.step import StepConfig
from lightning_memest.measure import measure_step

transformers = pytest.importorskip("transformers")
import_utils = pytest.importorskip("transformers.utils.import_utils")
masking_utils = pytest.importorskip("transformers.masking_utils")

BATCH, SEQ, VOCAB = 4, 64, 256


def causal_lm(kind: str = "llama", checkpointing: bool = False, **config: Any) -> Any:
    """A tiny causal LM as people configure one for training: grouped-query attention (4 query heads,
    2 key/value heads), SDPA, no KV cache."""
    torch.manual_seed(0)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    cfg = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
        use_cache=False,
        **config,
    )
    model = model_cls(cfg)
    if checkpointing:  # transformers 5 renamed gradient_checkpointing_enable
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def lm_batch(**extra: Tensor) -> dict[str, Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone(), **extra}


def lm_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**batch).loss  # type: ignore[no-any-return]


def padding_mask() -> Tensor:
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 50:] = 0
    mask[3, 40:] = 0
    return mask


def no_padding() -> Tensor:
    return torch.ones(BATCH, SEQ, dtype=torch.long)


#: name: (model kind, activation checkpointing, config, the batch's attention mask)
CASES: dict[str, tuple[str, bool, dict[str, Any], Callable[[], Tensor] | None]] = {
    # Before engine.real_path: +7.2 % / +5.8 % (first step / steady state), and +6.7 % / +4.8 % with
    # checkpointing: a (batch, 1, seq, seq) mask per forward that the real run does not build.
    "llama": ("llama", False, {}, None),
    "llama-checkpointing": ("llama", True, {}, None),
    # The real run reads the batch's mask: here it masks padding, so both build the 4-d mask ...
    "mistral-padding-sliding-window": ("mistral", False, {"sliding_window": 32}, padding_mask),
    # ... and here it masks nothing, so neither does.
    "mistral-no-padding-checkpointing": ("mistral", True, {}, no_padding),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_equals_the_real_step(case: str) -> None:
    kind, checkpointing, config, mask = CASES[case]
    model = causal_lm(kind, checkpointing, **config)
    batch = lm_batch(attention_mask=mask()) if mask is not None else lm_batch()

    est = estimate_step(model, batch, loss_fn=lm_loss, optimizer=torch.optim.AdamW)
    real = measure_step(copy.deepcopy(model), batch, StepConfig(loss_fn=lm_loss, optimizer=torch.optim.AdamW))

    for estimated, measured in (
        (est.first_step.bytes, real.first_step),
        (est.steady_state.bytes, real.steady_state),
    ):
        assert abs(estimated - measured) <= 0.001 * measured, (case, estimated, measured)
    assert not est.assumed_reads  # the values read were the real ones: nothing assumed


def test_tracing_checks_answer_as_in_a_real_run() -> None:
    from torch.fx._symbolic_trace import is_fx_tracing

    def checks(batch: dict[str, Tensor]) -> dict[str, bool]:
        ids = batch["input_ids"]
        return {
            "is_tracing": import_utils.is_tracing(ids),
            "is_fake_tensor": import_utils.is_fake_tensor(ids),
            "is_torchdynamo_compiling": import_utils.is_torchdynamo_compiling(),
            "is_torchdynamo_exporting": import_utils.is_torchdynamo_exporting(),
            "torch.compiler.is_compiling": torch.compiler.is_compiling(),
            "torch.jit.is_tracing": torch.jit.is_tracing(),  # type: ignore[attr-defined,no-untyped-call]
            "is_fx_tracing": is_fx_tracing(),
            "packed": masking_utils.find_packed_sequence_indices(batch["position_ids"]) is not None,
        }

    seen: list[dict[str, bool]] = []

    def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        seen.append(checks(batch))
        return model(batch["input_ids"].float()).sum()  # type: ignore[no-any-return]

    batch = {"input_ids": torch.ones(2, 8), "position_ids": torch.arange(8).repeat(2, 1)}
    real = checks(batch)
    estimate_step(nn.Linear(8, 2), batch, loss_fn=loss_fn, steps=1)
    assert seen == [real]
    assert not any(real.values())


def test_model_and_patched_functions_are_left_exactly_as_they_were() -> None:
    model = causal_lm(checkpointing=True)
    batch = lm_batch(attention_mask=padding_mask())
    before_batch = {k: v.clone() for k, v in batch.items()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = {id(m): {k: v for k, v in vars(m).items() if isinstance(v, Tensor)} for m in model.modules()}
    attrs = {id(m): set(vars(m)) for m in model.modules()}
    params = {n: (p, p.requires_grad, p.grad) for n, p in model.named_parameters()}

    def patched() -> tuple[object, ...]:
        rng_functions = (
            torch.get_rng_state,
            torch.set_rng_state,
            torch.random.get_rng_state,
            torch.random.set_rng_state,
        )
        return (import_utils.is_fake_tensor, *rng_functions)

    functions = patched()
    rng = torch.get_rng_state()

    estimate_step(model, batch, loss_fn=lm_loss, optimizer=torch.optim.AdamW)

    assert patched() == functions
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(batch[k], v) for k, v in before_batch.items())
    assert {id(m): set(vars(m)) for m in model.modules()} == attrs
    for m in model.modules():
        assert {k: v for k, v in vars(m).items() if isinstance(v, Tensor)} == tensors[id(m)]
    for name, (p, requires_grad, grad) in params.items():
        now = model.get_parameter(name)
        assert now is p and now.requires_grad == requires_grad and now.grad is grad
        assert type(now) is nn.Parameter and not hasattr(now, "fake_mode")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.training and all(layer.gradient_checkpointing for layer in model.model.layers)
    lm_loss(model, batch).backward()  # type: ignore[no-untyped-call]  # it still trains for real


def test_known_values_follow_the_code_and_are_forgotten_when_overwritten() -> None:
    mode = FakeTensorMode()
    lengths = torch.tensor([3, 1, 2])
    with mode:
        fake_lengths = mode.from_tensor(lengths)
    with real_path(mode, [(fake_lengths, lengths)]), mode:
        longest = int(fake_lengths.max())  # the batch's values
        order = torch.argsort(fake_lengths, descending=True)  # derived from them
        mask = torch.arange(4)[None, :] < fake_lengths[:, None]  # with a factory's
        selected = torch.nonzero(mask)  # a data-dependent size, exact
        fake_lengths.add_(torch.ones(3, dtype=torch.long))  # an in-place update from known values
        updated = known_value(fake_lengths).tolist()  # type: ignore[union-attr]
        weights = torch.randn(3)  # floats never have values
        view = fake_lengths[:2]
        fake_lengths.copy_(weights.long())  # overwritten from unknown values: forgotten, views too
    assert longest == 3 and known_value(order).tolist() == [0, 2, 1]  # type: ignore[union-attr]
    assert tuple(selected.shape) == (6, 2) and known_value(mask) is not None
    assert updated == [4, 2, 3]
    assert known_value(weights) is None and known_value(fake_lengths) is None and known_value(view) is None
    assert lengths.tolist() == [3, 1, 2]  # the batch itself is never written


def test_empty_factories_have_no_known_values() -> None:
    # A real empty_like/new_empty holds whatever the memory held: no values to know, also when its
    # tensor argument has known values.
    mode = FakeTensorMode()
    lengths = torch.tensor([3, 1, 2])
    with mode:
        fake_lengths = mode.from_tensor(lengths)
    with real_path(mode, [(fake_lengths, lengths)]), mode:
        like = torch.empty_like(fake_lengths)
        new = fake_lengths.new_empty(5)
        zeros = torch.zeros_like(fake_lengths)
    assert known_value(like) is None and known_value(new) is None
    assert known_value(zeros).tolist() == [0, 0, 0]  # type: ignore[union-attr]


def test_transformers_is_not_imported_when_the_user_has_not(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "transformers" or n.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    estimate_step(nn.Linear(4, 2), torch.randn(3, 4))
    assert "transformers.utils.import_utils" not in sys.modules


def test_the_report_lists_which_reads_were_exact_and_which_assumed() -> None:
    # A graph network's pooling sizes its output by the batch's graph ids (known: exact); a logged
    # `.item()` of the loss reads an activation (unknown: assumed). The report says which is which.
    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
            pooled = torch.zeros(int(graph.max()) + 1, 4).index_add(0, graph, x)
            return self.lin(pooled)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, graph, y = batch
        loss = F.cross_entropy(model(x, graph), y)
        loss.item()  # logging
        return loss

    graph = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    batch = (torch.randn(8, 4), graph, torch.tensor([0, 1, 2, 0]))
    est = estimate_step(Pool(), batch, loss_fn=loss_fn, optimizer=torch.optim.SGD, steps=1)
    reads = {(r.op, r.module, r.exact): r.assumed for r in est.data_dependent or ()}
    assert reads == {
        ("aten._local_scalar_dense.default", "", True): "its real value",
        ("aten._local_scalar_dense.default", "", False): "0.0",
    }
    assert [r.assumed for r in est.assumed_reads] == ["0.0"]
    text = str(est)
    assert "read tensor values 2 time(s): 1 exact (known values), 1 assumed" in text
    json_reads = est.to_json()["data_dependent"]
    assert sorted((r["exact"], r["assumed"]) for r in json_reads) == [
        (False, "0.0"),
        (True, "its real value"),
    ]


def test_the_summary_names_only_the_reads_that_were_assumed() -> None:
    # The model summary's footer row is for reads whose answer was assumed; reads of the batch's own
    # values were exact and get none.
    from lightning_memest.adapter.summary import footer_items

    class Pool(nn.Module):
        def forward(self, x: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
            return torch.zeros(int(graph.max()) + 1, 4).index_add(0, graph, x)

    graph = torch.tensor([0, 0, 1, 2])

    def exact(m: nn.Module, b: Any) -> torch.Tensor:
        return m(*b).sum()

    def assumed(m: nn.Module, b: Any) -> torch.Tensor:
        out = m(*b).sum()
        out.item()
        return out

    label = "Tensor values read (assumed, see MemEstimate.estimate)"
    for loss_fn, expected in ((exact, None), (assumed, "1")):
        est = estimate_step(Pool(), (torch.randn(4, 4, requires_grad=True), graph), loss_fn=loss_fn, steps=1)
        assert est.data_dependent, "the batch's graph ids were read"
        assert dict(footer_items(est)).get(label) == expected
