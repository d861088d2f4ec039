"""How libraries find out whether they are traced or compiled, and what the simulation answers.

Libraries take another code path when they think they are traced or compiled (they avoid reading
values, and build what a traced graph needs). They find out by looking at global flags or at the
tensors they get. Each check, what it looks at, and what the simulation answers (transformers 5.x,
torch 2.x):

* ``torch.compiler.is_compiling()`` (and ``torch._dynamo.is_compiling``, ``torch._utils.is_compiling``,
  transformers' ``is_torchdynamo_compiling``): the flag ``torch.compiler._is_compiling_flag``, set
  only while dynamo traces (a ``torch.compile`` or ``torch.export`` session). The simulation runs
  eagerly (``engine.compiled``: dynamo's force_eager stance), so it reads ``False``, as a real eager
  run does.
* ``torch.compiler.is_exporting()`` (transformers' ``is_torchdynamo_exporting``): the flag
  ``torch.compiler._is_exporting_flag``, set only by ``torch.export``: ``False`` in both.
* ``torch.jit.is_tracing()`` (transformers' ``is_jit_tracing``): the JIT tracer's thread-local state
  (``torch._C._is_tracing()``): ``False`` in both.
* ``torch.fx._symbolic_trace.is_fx_tracing()``: a thread-local flag set only inside
  ``Tracer.trace`` (``lightning_memest.fx`` traces *before* it simulates): ``False`` in both.
* transformers' ``is_cuda_stream_capturing`` / ``is_xpu_stream_capturing``: the real device's current
  stream (``torch.cuda.is_current_stream_capturing()``), untouched by fake tensors: ``False`` in both.
* transformers' ``is_torch_fx_proxy(x)`` (``isinstance(x, torch.fx.Proxy)``) and ``is_jax_jitting(x)``
  (``hasattr(x, "jax")``): ``False`` for a fake tensor as for a real one.
* transformers' ``is_fake_tensor(x)`` (``isinstance(x, FakeTensor)``): **the one that differs**. It is
  ``True`` for the simulation's tensors, so ``is_tracing(tensor)`` says "tracing", and the masking
  utilities (``find_packed_sequence_indices``, ``_ignore_causal_mask_sdpa``,
  ``_ignore_bidirectional_mask_sdpa``) stop reading the positions and the padding mask: every forward
  then builds a (batch, 1, query, key) attention mask that the real run skips (it passes
  ``is_causal=True`` to SDPA instead). Inside ``engine.real_path``, ``transformers.utils.import_utils.
  is_fake_tensor`` answers ``False`` for the simulation's own fake tensors (``is_tracing`` looks it up
  at each call, so every module that imported ``is_tracing`` sees it), and is put back on exit. It is
  patched only if transformers was already imported: the estimator never imports it.

The flags are left alone: patching them would make the simulation see what no eager run sees (a step
that is really compiled is estimated as eager; see ``simulate``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["transformers_sees_real_tensors"]


@contextmanager
def transformers_sees_real_tensors(mode: FakeTensorMode) -> Iterator[None]:
    """``transformers.utils.import_utils.is_fake_tensor`` says ``False`` for ``mode``'s tensors."""
    module = sys.modules.get("transformers.utils.import_utils")
    original: Callable[[object], bool] | None = getattr(module, "is_fake_tensor", None)
    if module is None or original is None:
        yield
        return
    checked = original

    def is_fake_tensor(x: object) -> bool:
        if isinstance(x, FakeTensor) and x.fake_mode is mode:
            return False  # a real run has a real tensor here
        return checked(x)

    setattr(module, "is_fake_tensor", is_fake_tensor)  # noqa: B010 (a module attribute mypy cannot see)
    try:
        yield
    finally:
        setattr(module, "is_fake_tensor", original)  # noqa: B010
