"""Generation-style steps (issue 17, item 5): ``model.generate`` of small causal LMs with a KV cache,
estimated on fake tensors against the CPU allocator's events of the real call (``torch.profiler``), and
the reads that decide when generation stops listed in the report.

A generation loop reads ``unfinished_sequences.max() == 0`` after every token. The simulation knows
that value once the maximum length is reached (``engine.values.value_sets``: ``full(True) | x``, ``~``,
``x & False``, ``max``, ``== 0``), and assumes "not finished" before (``engine.values.assumed_values``: an
unknown token is no end-of-sequence token): the estimate is of the longest generation. A loop that
waits on a value the simulation cannot know fails with a clear error (``engine.values.read_guard``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from probe import largest_rise, storage_blocks
from torch import Tensor, nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
)

from lightning_memest import EstimationError, estimate_step
from lightning_memest.accounting import account
from lightning_memest.allocator_events import CpuMemoryProfile, quiet_gc
from lightning_memest.engine.events import Phase
from lightning_memest.engine.simulate import simulate
from lightning_memest.engine.step import StepConfig, StepListener
from lightning_memest.engine.values import read_guard
from lightning_memest.report import StepEstimate

EOS = 7
PROMPT = 4
NEW_TOKENS = 24


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=128, eos_token_id=EOS, bos_token_id=EOS
    )
    return GPT2LMHeadModel(config).eval()


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(  # grouped-query attention: 4 query heads share 2 key/value heads
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config).eval()


def prompt() -> Tensor:
    torch.manual_seed(1)
    return torch.randint(EOS + 1, 128, (2, PROMPT))


def generate(model: nn.Module, ids: Tensor, **kwargs: Any) -> Tensor:
    torch.manual_seed(0)
    with torch.inference_mode():
        out: Tensor = model.generate(ids, pad_token_id=0, **kwargs)
    return out


class Generating:
    """A predict step that generates (a ``RunnerFactory`` once bound to its arguments)."""

    def __init__(self, model: nn.Module, listener: StepListener, kwargs: dict[str, Any]) -> None:
        self.model, self.listener, self.kwargs = model, listener, kwargs

    def run(self, batch: Tensor) -> Tensor:
        self.model.eval()
        self.listener.on_phase(Phase.FORWARD, 0)
        return generate(self.model, batch, **self.kwargs)


def estimated(model: nn.Module, ids: Tensor, **kwargs: Any) -> StepEstimate:
    def runner(m: nn.Module, config: StepConfig, listener: StepListener) -> Generating:
        return Generating(m, listener, kwargs)

    return account(simulate(model, ids, StepConfig(), runner=runner, steps=1))


def measured(model: nn.Module, ids: Tensor, **kwargs: Any) -> tuple[int, Tensor]:
    """The real call's peak: the largest rise of the CPU allocator's running sum during the call
    (``probe.largest_rise``), plus the weights and the prompt (each storage once: GPT-2 ties its
    embedding to its head)."""
    generate(model, ids, **kwargs)  # first-call caches (generation config) out of the way
    resident = storage_blocks([*model.parameters(), *model.buffers(), ids])
    with quiet_gc(), CpuMemoryProfile() as prof:
        out = generate(model, ids, **kwargs)
    return sum(resident.values()) + largest_rise(prof, resident), out


SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False},
    "top_k": {"do_sample": True, "top_k": 20},
}


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("build", [gpt2, llama])
def test_generate_is_estimated_within_1_percent(build: Any, sampling: str) -> None:
    model, ids = build(), prompt()
    kwargs = {"max_new_tokens": NEW_TOKENS, **SAMPLING[sampling]}
    est = estimated(model, ids, **kwargs)
    real, out = measured(model, ids, **kwargs)
    assert out.shape == (2, PROMPT + NEW_TOKENS)  # no end-of-sequence token came: the longest run
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)
    # one read per new token: "not finished" assumed until the maximum length makes it known
    assumed = {(r.op, r.assumed): r.count for r in est.assumed_reads}
    assert assumed == {
        ("aten.is_nonzero.default", "False (assumed: an unknown value equals no given value)"): NEW_TOKENS - 1
    }
    exact = {(r.op, r.assumed): r.count for r in est.data_dependent or () if r.exact}
    assert exact[("aten.is_nonzero.default", "True (the only value it can hold)")] == 1


class ForceEos(LogitsProcessor):
    """Every sequence ends at ``length`` tokens: the real loop stops there."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if input_ids.shape[1] < self.length:
            return scores
        forced = torch.full_like(scores, -float("inf"))
        forced[:, EOS] = 0.0
        return forced


def test_an_early_end_of_sequence_is_bounded_by_the_longest_run() -> None:
    model, ids = gpt2(), prompt()
    est = estimated(
        model, ids, max_new_tokens=NEW_TOKENS, logits_processor=LogitsProcessorList([ForceEos(PROMPT + 12)])
    )
    early, out = measured(
        model, ids, max_new_tokens=NEW_TOKENS, logits_processor=LogitsProcessorList([ForceEos(PROMPT + 12)])
    )
    longest, _ = measured(model, ids, max_new_tokens=NEW_TOKENS)
    assert out.shape[1] == PROMPT + 13 < PROMPT + NEW_TOKENS  # the real one stopped early
    assert early < est.peak_bytes  # an upper bound ...
    assert abs(est.peak_bytes - longest) <= 0.01 * longest  # ... of the longest generation


def test_a_hand_written_decode_loop_runs_to_its_maximum() -> None:
    # Both ways of asking "finished?": with the neutral answer (False) the second loop would stop after
    # its first token; an unknown token is assumed not to be the end-of-sequence one instead.
    def decode(model: nn.Module, ids: Tensor, steps: int) -> Tensor:
        finished = torch.zeros(ids.shape[0], dtype=torch.bool)
        with torch.inference_mode():
            for _ in range(steps):
                token = model(ids).logits[:, -1].argmax(-1)
                ids = torch.cat([ids, token[:, None]], dim=1)
                finished |= token == EOS
                if finished.all():
                    break
                if not (~finished).any():
                    break
        return ids

    class Decoding:
        def __init__(self, model: nn.Module, config: StepConfig, listener: StepListener) -> None:
            self.model, self.listener = model, listener

        def run(self, batch: Tensor) -> Tensor:
            self.model.eval()
            self.listener.on_phase(Phase.FORWARD, 0)
            return decode(self.model, batch, 10)

    model, ids = gpt2(), prompt()
    est = account(simulate(model, ids, StepConfig(), runner=Decoding, steps=1))
    assert {(r.assumed, r.count) for r in est.data_dependent or ()} == {
        ("False (assumed: an unknown value equals no given value)", 10),
        ("True (assumed: an unknown value equals no given value)", 10),
    }
    resident = storage_blocks([*model.parameters(), *model.buffers(), ids])
    with quiet_gc(), CpuMemoryProfile() as prof:
        out = decode(model, ids, 10)
    real = sum(resident.values()) + largest_rise(prof, resident)
    assert out.shape[1] == PROMPT + 10
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


def test_a_loop_waiting_on_an_unknown_value_fails_within_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_guard, "READ_LIMIT", 40)
    laps: list[int] = []

    def loss_fn(model: nn.Module, batch: Tensor) -> Tensor:
        h = model(batch)
        while not bool((h > 0).all()):  # converges in a real run; a fake one cannot know
            h = h + 1
            laps.append(1)
        return h.sum()

    # Too large to follow on its values (a 2048 x 1024 weight): the cap ends it, the line named.
    with pytest.raises(
        EstimationError,
        match=r"(?s)41 times at .*test_generation\.py:\d+ \(loss_fn\).*'weight' has 2,097,152 elements",
    ):
        estimate_step(nn.Linear(2048, 1024), torch.randn(2, 2048), loss_fn=loss_fn)
    assert len(laps) == 40
    # Small enough: simulated again on the batch's values and weights, the loop ends where the real one
    # does, and its condition is listed by its line with its count.
    laps.clear()
    torch.manual_seed(0)
    model, batch = nn.Linear(4, 4), torch.randn(2, 4)
    est = estimate_step(model, batch, loss_fn=loss_fn)
    assert est.followed_note is not None and "41 times" in est.followed_note
    h, real_laps = model(batch), 0
    while not bool((h > 0).all()):
        h, real_laps = h + 1, real_laps + 1
    site = [
        r for r in est.data_dependent or () if "test_generation.py" in r.assumed and "(loss_fn)" in r.assumed
    ]
    assert sum(r.count for r in site) == 2 * (real_laps + 1), (site, real_laps)  # two steps' conditions
    assert all(r.may_lower for r in site)


def test_loops_on_known_values_are_not_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_guard, "READ_LIMIT", 5)

    def loss_fn(model: nn.Module, batch: Tensor) -> Tensor:
        n = torch.zeros((), dtype=torch.long)
        while int(n) < 20:  # the real values: the loop runs as the real one does
            n = n + 1
        return model(batch).sum() * n

    est = estimate_step(nn.Linear(4, 4), torch.randn(2, 4), loss_fn=loss_fn)
    assert not est.assumed_reads
    # every read listed as exact: 21 per step (20 turns and the exit), 2 steps
    assert [(r.op, r.exact, r.count) for r in est.data_dependent or ()] == [
        ("aten._local_scalar_dense.default", True, 42)
    ]
