"""FLOPs of a training step, from the same fake run (the same event stream) as the memory estimate.

**Headline FLOPs** are 2 x the multiply-accumulates of matrix products, convolutions and attention --
the convention of ``torch.utils.flop_counter``, Lightning's ``ThroughputMonitor`` and MFU papers, so the
numbers compare with theirs and with a device's peak FLOP/s. They are built on torch's formula registry
(``torch.utils.flop_counter.flop_registry``, whose formulas take ``torch.Size`` shapes), with its defects
fixed (torch 2.14.1):

* the weight-gradient term of grouped (and depthwise) convolution backward ignores ``groups`` (torch gives
  mobilenet_v2 a backward/forward ratio of 19.4, efficientnet_b0 40.7; here both are 2);
* the CPU attention kernels ``_scaled_dot_product_flash_attention_for_cpu`` and its backward are unknown to
  it (attention counts 0 on CPU);
* oneDNN's LSTM (``mkldnn_rnn_layer`` and its backward) and cuDNN's RNN (``_cudnn_rnn`` and its backward),
  ``mv``/``addmv``/``dot``/``addbmm``/``_addmm_activation`` are unknown to it.

Attention follows torch's convention: the two ``seq x seq`` products are counted in full even when
``is_causal`` (4 * batch * heads * seq_q * seq_k * head_dim forward, 2.5 x that backward), as the kernels
of FlashAttention-style papers and ``FlopCounterMode`` report them.

**Other FLOPs** (elementwise, normalization, softmax, pooling, reductions, the optimizer's arithmetic) are
counted separately, with a simple convention, so that the headline stays comparable:

* a pointwise op (``torch.Tag.pointwise``, the ``*_backward`` of a pointwise op, ``_foreach_*``): 1 FLOP
  per output element (per element of its first tensor list for ``_foreach_*``); copies (``clone``,
  ``copy_``, ``_to_copy``) and data movement (views, ``cat``, indexing, ``embedding``) count 0;
* a reduction (``torch.Tag.reduction``: ``sum``, ``mean``, ``amax`` ...): 1 FLOP per input element;
* normalization (batch/layer/group/RMS norm): 5 per input element forward, 8 backward;
* softmax / log-softmax: 5 per element forward, 4 backward; the softmax inside fused attention kernels
  counts the same per ``seq_q x seq_k`` score (5 forward, 6 backward: recomputation included);
* pooling: kernel volume per output element (forward, and the backward of average pooling); 1 per element
  of the output gradient for max-pool backward; adaptive average pooling as a reduction;
* the loss: ``nll_loss`` 1 per target element; ``embedding_dense_backward`` 1 per gradient element;
* fused optimizers (``_fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_``): as many per parameter element
  as their unfused (for-loop) implementation's pointwise ops have.

Figures are those of the **first** step (step 0) of the simulation, by phase (forward, backward,
optimizer; ``zero_grad`` and set-up count nowhere), and per module (inclusive of its children; the root
module ``""`` also holds what ran outside any module, like the loss).

The formulas need the op's full call, so the engine must capture it: pass :func:`captures_flops` (or a
filter that includes it) as ``simulate(..., capture=...)``.
Where each concept lives: ``formulas.py`` (the two registries, their lookups and the default rules),
``products.py`` (matrix products and convolutions), ``attention.py``, ``rnn.py``, ``elementwise.py``
(normalization, softmax, pooling, losses, optimizers) and ``count.py`` (the count over the event
stream). A new formula is a small function registered in the file of its op family.

Example:
    >>> import torch
    >>> from lightning_memest.engine.simulate import simulate
    >>> from lightning_memest.engine.step import StepConfig
    >>> sim = simulate(torch.nn.Linear(64, 32), torch.randn(8, 64), StepConfig(), steps=1,
    ...                capture=captures_flops)
    >>> flops = count_flops(sim.events)
    >>> flops.forward, flops.backward  # 2*8*64*32; backward: grad-weight only (the input needs no grad)
    (32768, 32768)
    >>> flops.optimizer is None  # no optimizer in this step
    True
"""

from __future__ import annotations

# Imported for their registrations.
from lightning_memest.accounting.flops import attention, elementwise, products, rnn  # noqa: F401
from lightning_memest.accounting.flops.count import FlopObserver, count_flops
from lightning_memest.accounting.flops.formulas import (
    FLOP_FORMULAS,
    OTHER_FLOP_FORMULAS,
    FlopFormula,
    captures_flops,
    flop_formula_for,
    other_flop_formula_for,
)
from lightning_memest.report import FlopCount, ModuleFlops, OpFlops

__all__ = [
    "FLOP_FORMULAS",
    "OTHER_FLOP_FORMULAS",
    "FlopCount",
    "FlopFormula",
    "FlopObserver",
    "ModuleFlops",
    "OpFlops",
    "captures_flops",
    "count_flops",
    "flop_formula_for",
    "other_flop_formula_for",
]
