"""Cases to estimate and measure, built from plain settings: a model spec, an input, a loss, an optimizer.

This is what ``memest`` does with its flags, kept apart from argument parsing so that benchmarks build
exactly the same cases as the command line:

* a **model spec** ``package.module:name`` names an ``nn.Module`` class or a factory
  (:func:`build_model`); factories that take ``weights`` (torchvision's) get ``weights=None`` unless
  the caller passes one, so nothing is downloaded;
* an :class:`InputSpec` makes the batch: ``torch.randn(B, *shape)`` or ``torch.randint(0, V, (B, SEQ))``;
* the loss is ``cross_entropy`` against a random integer target, or ``sum`` of the output;
* the optimizer is ``sgd`` (lr 0.01, momentum 0.9), ``adam`` / ``adamw`` (lr 1e-3) or ``none``.

:func:`build_case` puts them together into a :class:`Case`; :func:`estimate_case` and
:func:`measure_case` run the estimator and the ground truth on it.

Nothing that grows with the batch is real until a real step needs it: building a case checks the
input against the model on fake tensors, the estimate gets the batch's shapes on the meta device
(:attr:`Case.estimate_batch`), and only :func:`measure_case` materialises its values
(:attr:`Case.batch`, seeded). So a batch of any size can be estimated on any machine.

Example:
    >>> from lightning_memest.cases import InputSpec, build_case, measure_case
    >>> case = build_case("torch.nn:Linear", InputSpec(batch_size=4, shape=(8,)),
    ...                   model_kwargs={"in_features": 8, "out_features": 3}, optimizer="sgd")
    >>> [tuple(t.shape) for t in case.batch]  # the input, and the cross-entropy target
    [(4, 8), (4,)]
    >>> measure_case(case).first_step > 0
    True
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_memest.accounting.cuda_device import CudaDevice
from lightning_memest.batches import resize_batch
from lightning_memest.cases.input_check import output_shape
from lightning_memest.constants import (
    COMPILE_MODES,
    DEFAULT_BATCH_SIZE,
    DEFAULT_LOSS,
    DEFAULT_OPTIMIZER,
    LOSSES,
    OPTIMIZERS,
)
from lightning_memest.engine.inference_step import PlainLoop
from lightning_memest.engine.parallel.distributed import Strategy
from lightning_memest.engine.real_path import VALUE_LIMIT
from lightning_memest.engine.step import (
    LossFn,
    OptimizerFactory,
    Precision,
    StepConfig,
    check_precision,
    first_output,
    sum_loss,
    true_dtype,
)
from lightning_memest.errors import SpecError, one_line
from lightning_memest.estimate import estimate
from lightning_memest.measure import Measurement, measure_step
from lightning_memest.report import StepEstimate

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_LOSS",
    "DEFAULT_OPTIMIZER",
    "LOSSES",
    "OPTIMIZERS",
    "Case",
    "InputSpec",
    "SpecError",
    "build_case",
    "build_model",
    "case_batch_maker",
    "cross_entropy_loss",
    "estimate_case",
    "make_optimizer",
    "measure_case",
    "resolve_model",
    "resolve_object",
    "stage_cross_entropy",
]


# --------------------------------------------------------------------------------------------- models


def resolve_model(spec: str) -> Callable[..., Any]:
    """The class or factory that ``spec`` (``package.module:name``) names; the module is imported.

    ``name`` may be dotted (``module:Outer.factory``).

    >>> resolve_model("torch.nn:Linear")
    <class 'torch.nn.modules.linear.Linear'>
    """
    obj = resolve_object(spec, "model")
    if isinstance(obj, nn.Module):
        raise SpecError(
            f"{spec!r} is a module instance; name its class or a factory, so that a fresh model can be built"
        )
    if not callable(obj):
        raise SpecError(f"{spec!r} is not an nn.Module class or a factory (it is a {type(obj).__name__!r})")
    return obj  # type: ignore[no-any-return]


def resolve_object(spec: str, what: str) -> Any:
    """The object ``spec`` (``package.module:name``, ``name`` perhaps dotted) names, its module
    imported; a ``SpecError`` naming ``what`` it was to be (``"model"``, ``"--tp-plan"``) otherwise.

    >>> resolve_object("torch.nn:Linear", "model").__name__
    'Linear'
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"{what} {spec!r} is not of the form package.module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        # ModuleNotFoundError for the named module itself; any other ImportError came from inside it.
        raise SpecError(f"cannot import module {module_name!r} of {what} {spec!r}: {e}") from e
    except Exception as e:  # an import runs arbitrary code; its failure is the user's module's, not ours
        raise SpecError(f"importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _accepts_weights(factory: Callable[..., Any]) -> bool:
    try:
        return "weights" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins and some C extensions have no signature
        return False


def build_model(spec: str, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """A new model from ``spec``, called with ``kwargs`` (plus ``weights=None`` where it takes weights).

    Example:
        >>> model = build_model("torchvision.models:resnet18")  # random weights, nothing downloaded
        >>> type(model).__name__
        'ResNet'
    """
    factory = resolve_model(spec)
    call_kwargs = dict(kwargs or {})
    # torchvision factories default to weights=None today, but a factory may default to pretrained
    # weights (a download); the estimate never needs trained values, so ask for none explicitly.
    if "weights" not in call_kwargs and _accepts_weights(factory):
        call_kwargs["weights"] = None
    try:
        model = factory(**call_kwargs)
    except Exception as e:
        raise SpecError(f"building {spec!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise SpecError(f"{spec!r} did not build an nn.Module (it returned a {type(model).__name__!r})")
    return model


# --------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputSpec:
    """The model's input: floats ``(batch_size, *shape)``, or ids ``(batch_size, tokens)`` below ``vocab``.

    >>> InputSpec(batch_size=2, shape=(3, 4, 4)).make().shape
    torch.Size([2, 3, 4, 4])
    >>> InputSpec(batch_size=2, tokens=5, vocab=100).make().dtype
    torch.int64
    """

    batch_size: int = DEFAULT_BATCH_SIZE
    shape: tuple[int, ...] | None = None
    tokens: int | None = None
    vocab: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise SpecError(f"the batch size must be at least 1; got {self.batch_size}")
        if (self.shape is None) == (self.tokens is None):
            raise SpecError("give exactly one input: a shape, or a sequence length and a vocabulary")
        if self.shape is not None and (not self.shape or any(d < 1 for d in self.shape)):
            raise SpecError(f"the input shape must be positive sizes; got {self.shape}")
        if self.tokens is not None:
            if self.tokens < 1:
                raise SpecError(f"the sequence length must be at least 1; got {self.tokens}")
            if self.vocab is None or self.vocab < 1:
                raise SpecError(f"token inputs need a vocabulary size of at least 1; got {self.vocab}")
        elif self.vocab is not None:
            raise SpecError("a vocabulary size only goes with token inputs")

    @property
    def dtype(self) -> torch.dtype:
        """float32 for ``shape`` inputs, int64 for token ids."""
        return torch.float32 if self.shape is not None else torch.int64

    def sizes(self, rows: int | None = None) -> tuple[int, ...]:
        """The input's shape, with ``rows`` rows (default: the batch size)."""
        n = self.batch_size if rows is None else rows
        return (n, *self.shape) if self.shape is not None else (n, self.tokens or 0)

    @property
    def value_range(self) -> tuple[int, int] | None:
        """The values token ids can take (``0 .. vocab - 1``); ``None`` for float inputs."""
        return None if self.vocab is None else (0, self.vocab - 1)

    def make(self, rows: int | None = None, *, generator: torch.Generator | None = None) -> Tensor:
        """A new random input of ``rows`` rows (default: the batch size), from ``generator`` (default:
        the current torch RNG)."""
        if self.shape is not None:
            return torch.randn(self.sizes(rows), generator=generator)
        assert self.vocab is not None  # __post_init__ checked it
        return torch.randint(0, self.vocab, self.sizes(rows), generator=generator)

    def describe(self) -> str:
        """``'batch 8 x 3x224x224'`` or ``'batch 8 x 128 tokens < 50257'``."""
        if self.shape is not None:
            return f"batch {self.batch_size} x {'x'.join(map(str, self.shape))}"
        return f"batch {self.batch_size} x {self.tokens} tokens < {self.vocab}"


def parse_shape(text: str) -> tuple[int, ...]:
    """``'3,224,224'`` -> ``(3, 224, 224)``.

    >>> parse_shape("3, 32,32")
    (3, 32, 32)
    """
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SpecError(
            f"the input shape must be comma-separated sizes such as 3,224,224; got {text!r}"
        ) from None
    if any(d < 1 for d in shape):
        raise SpecError(f"the input shape must be positive sizes; got {text!r}")
    return shape


# ----------------------------------------------------------------------------------- loss, optimizer


def cross_entropy_loss(model: nn.Module, batch: Any) -> Tensor:
    """Cross entropy of the model's output on ``batch[0]`` against the class ids ``batch[1]``.

    The last output dimension holds the classes; any dimensions before it (batch, sequence) are
    flattened, so one function serves classifiers ``(B, C)`` and language models ``(B, SEQ, V)``.
    """
    x, target = batch
    return stage_cross_entropy(model(x), target)


def stage_cross_entropy(output: Any, target: Tensor) -> Tensor:
    """:func:`cross_entropy_loss` of an output already computed: a pipeline's last stage computes it
    so, per microbatch (the schedule's ``loss_fn``)."""
    out = first_output(output)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def make_optimizer(name: str) -> OptimizerFactory | None:
    """The optimizer factory for ``name`` (``None`` for ``'none'``).

    >>> opt = make_optimizer("sgd")([torch.nn.Parameter(torch.zeros(2))])
    >>> opt.defaults["lr"], opt.defaults["momentum"]
    (0.01, 0.9)
    """
    if name == "sgd":
        return functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)
    if name == "adam":
        return functools.partial(torch.optim.Adam, lr=1e-3)
    if name == "adamw":
        return functools.partial(torch.optim.AdamW, lr=1e-3)
    if name == "none":
        return None
    raise SpecError(f"the optimizer must be one of {', '.join(OPTIMIZERS)}; got {name!r}")


# ---------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """A model, its input and a step configuration, ready for :func:`estimate_case` /
    :func:`measure_case`.

    The batch is the input tensor (``sum`` loss) or ``(input, target)`` (``cross_entropy``: the target
    is made before the first step, so it is part of what is resident, in the estimate and the
    measurement alike). It exists in two forms: :attr:`estimate_batch` (shapes on the meta device:
    what the estimator needs, at no cost) and :attr:`batch` (real values, seeded, made on first use:
    what a real step needs). The model is on the CPU, in float32; the ``*-true`` conversion and the
    move to a device happen in :func:`estimate_case` / :func:`measure_case`.

    Example:
        >>> case = build_case("torch.nn:Linear", InputSpec(batch_size=100_000, shape=(8,)),
        ...                   model_kwargs={"in_features": 8, "out_features": 3})
        >>> x, target = case.estimate_batch  # 3.2 MB of inputs: not made (the class ids are followed)
        >>> x.device.type, target.device.type
        ('meta', 'cpu')
    """

    spec: str
    model: nn.Module
    config: StepConfig
    input: InputSpec
    target: tuple[tuple[int, ...], int] | None
    """The cross-entropy target's shape and number of classes (``None`` for the ``sum`` loss)."""
    seed: int = 0

    def _batch(self, real: Callable[[Tensor], bool]) -> Any:
        """The batch, each tensor real where ``real(meta_tensor)`` says so, else on the meta device.
        Values come from a generator seeded per tensor, so every form holds the same values."""

        def tensor(k: int, meta: Tensor, make: Callable[[torch.Generator], Tensor]) -> Tensor:
            return make(torch.Generator().manual_seed(self.seed * 2 + k)) if real(meta) else meta

        spec = self.input
        inputs = torch.empty(spec.sizes(), dtype=spec.dtype, device="meta")
        x = tensor(0, inputs, lambda g: spec.make(generator=g))
        if self.target is None:
            return x
        shape, classes = self.target
        ids = torch.empty(shape, dtype=torch.int64, device="meta")
        return x, tensor(1, ids, lambda g: torch.randint(0, classes, shape, generator=g))

    @property
    def estimate_batch(self) -> Any:
        """The batch for the estimator: shapes on the meta device, but integer tensors small enough for
        the simulation to follow their values (``engine.real_path``: token ids, class ids; at most
        ``VALUE_LIMIT`` elements, whatever the batch size), which hold the values :attr:`batch` has --
        so a step that reads them reads the same in both runs."""
        return self._batch(lambda t: not t.is_floating_point() and t.numel() <= VALUE_LIMIT)

    @functools.cached_property
    def batch(self) -> Any:
        """The batch with real values, for real steps (made on first use, the same values each time)."""
        return self._batch(lambda t: True)


def build_case(
    spec: str,
    input: InputSpec,
    *,
    model_kwargs: Mapping[str, Any] | None = None,
    loss: str = DEFAULT_LOSS,
    optimizer: str = DEFAULT_OPTIMIZER,
    precision: str = "32-true",
    seed: int = 0,
    compile_mode: str | None = None,
) -> Case:
    """Build the model of one case (seeded, so that every build gives the same weights) and check the
    input against it, on fake tensors: nothing of the batch is made yet (see :class:`Case`).

    Raises :class:`SpecError` for anything the settings cannot make (unknown model, bad loss or
    optimizer name, an input the model rejects, an output cross entropy cannot use). ``compile_mode``
    (``"default"``, ``"max-autotune-no-cudagraphs"``) wraps the model in ``torch.compile`` after the
    probe: the estimate simulates the compiled step, a measurement runs it.

    Example:
        >>> case = build_case("torch.nn:Embedding", InputSpec(batch_size=2, tokens=6, vocab=50),
        ...                   model_kwargs={"num_embeddings": 50, "embedding_dim": 50})
        >>> case.batch[1].shape  # one class id per token
        torch.Size([2, 6])
    """
    try:
        prec: Precision = check_precision(precision)
    except ValueError as e:
        raise SpecError(str(e)) from None
    if loss not in LOSSES:
        raise SpecError(f"the loss must be one of {', '.join(LOSSES)}; got {loss!r}")
    opt = make_optimizer(optimizer)
    torch.manual_seed(seed)
    model = build_model(spec, model_kwargs)
    model.train()
    # Always probe: it turns an input the model rejects into one clear error before any real run.
    out_shape = output_shape(model, input)
    loss_fn: LossFn = sum_loss
    target = None
    if loss == "cross_entropy":
        if len(out_shape) < 2:
            raise SpecError(
                f"cross_entropy needs an output with a class dimension last; {spec!r} returns shape "
                f"{tuple(out_shape)} (use --loss sum)"
            )
        target, loss_fn = (tuple(out_shape[:-1]), int(out_shape[-1])), cross_entropy_loss
    if compile_mode is not None:
        if compile_mode not in COMPILE_MODES:
            raise SpecError(
                f"the compile mode must be one of {', '.join(COMPILE_MODES)}; got {compile_mode!r}"
            )
        model = cast(nn.Module, torch.compile(model, mode=compile_mode))
    return Case(spec, model, StepConfig(loss_fn=loss_fn, optimizer=opt, precision=prec), input, target, seed)


def _convert_batch(batch: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if isinstance(batch, Tensor):
        if dtype is not None and batch.is_floating_point():
            batch = batch.to(dtype)
        return batch.to(device)
    if isinstance(batch, tuple):
        return tuple(_convert_batch(b, device, dtype) for b in batch)
    raise TypeError(f"unexpected batch element {type(batch).__name__}")


def estimate_case(
    case: Case,
    *,
    device: str = "cpu",
    steps: int = 2,
    strategy: Strategy | None = None,
    gpu: CudaDevice | None = None,
    calibrate: bool = False,
    loop: PlainLoop = "train",
    replay_blocks: bool = True,
) -> StepEstimate:
    """Estimate the case (the model is untouched; with a ``strategy``, as one rank of it; with
    ``calibrate``, the kernels measured on this machine; ``loop``: a training step, or one validation
    or predict batch; ``replay_blocks``: repeated blocks replayed; see ``estimate_step``).

    The estimator converts for ``*-true`` precisions and places the fake tensors on ``device`` itself,
    so the CPU float32 model and batch go in as they are.
    """
    config = case.config if strategy is None else dataclasses.replace(case.config, strategy=strategy)
    batch = _for_loop(case, case.estimate_batch, loop)
    return estimate(
        case.model,
        batch,
        config,
        device=device,
        steps=steps,
        gpu=gpu,
        calibrate=calibrate,
        loop=loop,
        replay_blocks=replay_blocks,
    )


def measure_case(
    case: Case, *, device: str = "cpu", steps: int = 2, loop: PlainLoop = "train"
) -> Measurement:
    """Run and measure real training steps of the case; **trains ``case.model`` in place**. ``loop``:
    a validation or predict batch instead (one; the model is left as it was).

    For ``*-true`` precisions the model and the float inputs are converted first (``measure_step``
    expects that of its caller); for ``cuda`` they are moved to the current CUDA device.
    """
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise SpecError("cannot measure on cuda: CUDA is not available on this machine")
    if target.type not in ("cpu", "cuda"):
        raise SpecError(f"the device must be cpu or cuda; got {device!r}")
    dtype = true_dtype(case.config.precision)
    model = case.model
    if dtype is not None:
        model = model.to(dtype)
    model = model.to(target)
    batch = _convert_batch(_for_loop(case, case.batch, loop), target, dtype)
    try:
        return measure_step(model, batch, case.config, steps=steps if loop == "train" else 1, loop=loop)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        # The real step runs the user's model on real values, which can fail where the shapes fitted
        # (token ids beyond an embedding's size, say): a problem of the case, not of the measurement.
        what = "training step" if loop == "train" else f"{loop} batch"
        raise SpecError(f"the real {what} failed: {type(e).__name__}: {one_line(e)}") from e


def _for_loop(case: Case, batch: Any, loop: PlainLoop) -> Any:
    """A predict batch is the input alone: nothing to compare a prediction with."""
    return batch[0] if loop == "predict" and case.target is not None else batch


def case_batch_maker(case: Case) -> Callable[[int], Any]:
    """``make_batch`` for a :class:`Case`: its batch (the input, and the
    cross-entropy target made from the output's shape) resized, on the meta device.

    >>> case = build_case("torch.nn:Linear", InputSpec(batch_size=4, shape=(8,)),
    ...                   model_kwargs={"in_features": 8, "out_features": 3})
    >>> [tuple(t.shape) for t in case_batch_maker(case)(100)]
    [(100, 8), (100,)]
    """
    old, batch = case.input.batch_size, case.estimate_batch
    return lambda n: resize_batch(batch, old, n)
