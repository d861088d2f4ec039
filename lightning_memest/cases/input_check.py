"""A case's input checked against its model before any run: the shape of the model's output (which gives
the cross-entropy target its shape), from a forward on fake tensors -- or, where the forward reads
tensor values, a real one on two rows -- with index ops checked against the values the input is made
with (``index_bounds``), and the model left as it was.

Example:
    >>> import torch
    >>> from lightning_memest.cases import InputSpec
    >>> output_shape(torch.nn.Linear(8, 3), InputSpec(batch_size=100_000, shape=(8,)))  # nothing real
    torch.Size([100000, 3])
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lightning_memest.cases.index_bounds import IndexBounds, OutOfBoundsError
from lightning_memest.engine.step import first_output
from lightning_memest.errors import SpecError, one_line

if TYPE_CHECKING:
    from lightning_memest.cases import InputSpec

__all__ = ["output_shape"]


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Undo what a forward does to ``model``: attributes it sets (caches) and buffers it updates."""
    saved = []
    for module in model.modules():
        state = {
            key: dict(value) if key in ("_parameters", "_buffers", "_modules") else value
            for key, value in vars(module).items()
        }
        saved.append((module, state))
    buffers = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in buffers:
                b.copy_(copy)
        for module, state in saved:
            attrs = vars(module)
            for key in [k for k in attrs if k not in state]:
                del attrs[key]
            for key, value in state.items():
                if isinstance(value, dict) and key in ("_parameters", "_buffers", "_modules"):
                    attrs[key].clear()
                    attrs[key].update(value)
                else:
                    attrs[key] = value


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


def _bounds(model: nn.Module, input: InputSpec, x: Tensor) -> IndexBounds:
    """Index ops of the forward checked against the values ``x`` is made with (``index_bounds``)."""
    ranges = {}
    if input.value_range is not None:
        ranges[x] = (*input.value_range, "the token ids")
    return IndexBounds(ranges, names={**dict(model.named_parameters()), **dict(model.named_buffers())})


def _fake_forward_shape(model: nn.Module, input: InputSpec) -> torch.Size:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # FakeTensorMode logs a traceback when a meta kernel rejects its inputs; here that is an answer
    # (the input does not fit), which output_shape reports in one line of its own.
    quiet = _quiet_logger("torch._subclasses.fake_tensor")
    # allow_non_fake_inputs: the real parameters are converted on first use; nothing real is computed.
    with quiet, _restored(model), torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(input.sizes(), dtype=input.dtype)  # fake: a batch of any size costs nothing
        with _bounds(model, input, x):
            return first_output(model(x)).shape


def _real_forward_shape(model: nn.Module, input: InputSpec) -> torch.Size:
    # Two rows rather than one: batch-norm in training mode rejects a single value per channel.
    x = input.make(rows=min(input.batch_size, 2), generator=torch.Generator().manual_seed(0))
    with _restored(model), torch.no_grad(), _bounds(model, input, x):
        shape = first_output(model(x)).shape
    return torch.Size((input.batch_size, *shape[1:]))


def output_shape(model: nn.Module, input: InputSpec) -> torch.Size:
    """The shape of the model's (first) output on an input of ``input``, leaving the model as it was.

    The forward runs on fake tensors, so it costs no real compute or memory at any batch size. Where
    that fails (a forward that reads tensor values, such as ``.item()`` or a mask check, which fake
    tensors cannot answer), it runs for real on two rows under ``no_grad`` and the batch size is put
    back; buffers and attributes the forward changed are restored either way. Index ops are checked
    against the values the input is made with (token ids ``0 .. vocab - 1``, and positions from
    them; see ``index_bounds``). An input the model rejects raises :class:`SpecError` with the
    model's own message.

    >>> from lightning_memest.cases import InputSpec
    >>> output_shape(torch.nn.Linear(8, 3), InputSpec(batch_size=5, shape=(8,)))
    torch.Size([5, 3])
    >>> output_shape(torch.nn.Embedding(10, 4), InputSpec(batch_size=2, tokens=3, vocab=500))
    Traceback (most recent call last):
    ...
    lightning_memest.errors.SpecError: the model rejects the input: the token ids (0 .. 499) index weight (aten.embedding), which has 10 rows: the real step fails with IndexError: index out of range in self
    """  # noqa: E501
    try:
        return _fake_forward_shape(model, input)
    except OutOfBoundsError as e:
        raise SpecError(f"the model rejects the input: {e}") from None
    except Exception as fake_error:
        try:
            return _real_forward_shape(model, input)
        except OutOfBoundsError as e:
            raise SpecError(f"the model rejects the input: {e}") from None
        except Exception as e:
            message = one_line(e)
            shape = tuple(input.sizes())
            rows = f" (tried for real on its first {min(input.batch_size, 2)} rows)" if shape[0] > 2 else ""
            raise SpecError(f"the model rejected an input of shape {shape}{rows}: {message}") from fake_error
