"""What a stand-in replays (``engine.replay.block_replay``): a template built from the signatures of
recorded blocks (``engine.replay.blocks``), checked for what a stand-in can make -- its outputs and the
gradients it hands back, dense storages the block allocated -- and for what it must hold.

Example:
    >>> import torch
    >>> dense(((2, 3), (3, 1), 0, torch.float32, 24, False))  # contiguous: 6 floats
    True
    >>> dense(((2, 3), (3, 1), 0, torch.float32, 28, False))  # a view into a larger storage
    False
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lightning_memest.engine.events import Role
from lightning_memest.engine.replay.blocks import BlockRecord, Canon, Layout

__all__ = ["Template", "backward_into", "dense", "forward_template"]


@dataclass
class Template:
    """What a stand-in replays, checked once per step: the forward program (block 1's), its outputs, and
    later the backward program (block N-2's)."""

    record: BlockRecord
    forward: tuple[Any, ...]
    outputs: tuple[Canon, ...]
    output_layouts: tuple[Layout, ...]
    output_spec: Any
    grad_leaf: int  # which input leaf needs its gradient
    grad_output: int  # which output leaf carries the gradient
    hold_inputs: tuple[int, ...]
    hold_outputs: tuple[int, ...]
    linked: tuple[int, ...]  # internal storages outliving both spans: they die with the template's
    backward: tuple[Any, ...] | None = None
    grad_input: Canon | None = None
    grad_input_layout: Layout | None = None
    param_grads: tuple[tuple[Canon | None, Layout | None], ...] = ()
    backward_real: Counter[str] = field(default_factory=Counter)  # block N-2's ops run for real


def forward_template(record: BlockRecord, sig: tuple[Any, ...]) -> Template | None:
    """What stand-ins replay of ``record`` (block 1), or ``None`` where a stand-in could not make its
    outputs: they must be storages the block allocated, one each, dense."""
    input_key, forward, outputs, layouts, spec = sig[:5]
    if any(c[0] != "i" for c in outputs) or len(set(outputs)) != len(outputs):
        return None
    if any(not dense(lay) for lay in layouts):
        return None
    grad_leaf = [
        k for k, part in enumerate(input_key[1]) if part[0] != "v" and part[0] != "obj" and part[0][5]
    ]
    grad_output = [i for i, lay in enumerate(layouts) if lay[5]]
    if len(grad_leaf) != 1 or len(grad_output) != 1:
        return None
    freed = {ins[1] for ins in forward if ins[0] == "free"}
    allocated = [ins[1] for ins in forward if ins[0] == "alloc"]
    saved = {ins[1] for ins in forward if ins[0] == "tag" and ins[2] is Role.ACTIVATION}
    if any(c[0] in ("p", "b") for c in freed):
        return None
    return Template(
        record,
        forward,
        outputs,
        layouts,
        spec,
        grad_leaf[0],
        grad_output[0],
        tuple(sorted(k for kind, k in saved if kind == "in")),
        tuple(i for i, c in enumerate(outputs) if c in saved),
        tuple(c[1] for c in allocated if c not in freed and c not in outputs),
    )


def backward_into(template: Template, record: BlockRecord, sig: tuple[Any, ...]) -> bool:
    """Put ``record``'s (block N-2's) backward into ``template``; ``False`` where what it leaves alive
    is not exactly the input's gradient and the parameters' (what a stand-in makes for real). A
    parameter's gradient is either new (a storage the backward made) or the one it held before,
    accumulated into in place (``("pg", j)``: the ``j``-th parameter's own)."""
    backward, (grad_input, layout, param_grads) = sig[5], sig[6]
    if backward is None or grad_input is None or layout is None:
        return False
    freed = {ins[1] for ins in backward if ins[0] == "free"}
    if any(c[0] in ("p", "b", "pg") for c in freed):
        return False
    left = {ins[1] for ins in backward if ins[0] == "alloc"} - freed
    kept = [c for c, _ in param_grads if c is not None and c[0] == "pg"]
    if any(c != ("pg", j) for j, (c, _) in enumerate(param_grads) if c is not None and c[0] == "pg"):
        return False
    made = {c for c, _ in param_grads if c is not None and c[0] != "pg"}
    if len(made) + len(kept) != sum(c is not None for c, _ in param_grads):
        return False
    # The input's gradient is a storage the backward made, or the output's gradient itself: autograd
    # adds a residual's two gradients into the one it holds last (``Tracker._accumulate_in_place``).
    if grad_input == ("go", 0):
        if ("go", 0) in freed:
            return False
    elif grad_input[0] == "i" and grad_input not in made:
        made.add(grad_input)
    else:
        return False
    if left != made:
        return False
    template.backward = backward
    template.grad_input = grad_input
    template.backward_real = record.backward_real
    template.grad_input_layout = layout
    template.param_grads = param_grads
    return True


def dense(lay: Layout) -> bool:
    """Whether ``empty_strided`` makes a tensor of this layout: no offset, a storage just big enough."""
    shape, stride, offset, dtype, nbytes, _ = lay
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    return offset == 0 and extent * dtype.itemsize == nbytes
