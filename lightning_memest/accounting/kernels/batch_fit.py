"""Calibrated kernel memory at any batch size, from calibrations at two: each op signature's line.

Calibration (``calibrate.py``) measures each op signature of a step by running it for real. A batch-size
search asks for a dozen sizes, each with its own signatures (the batch dimension is in the shapes and
strides): calibrating every probe would cost a real step per probe. But the step runs the same ops at
every size, and an op's shapes and its kernel's memory both follow the batch size: the weight's
reorder does not change with it, the activations' reorders grow in proportion. So two calibrations,
at sizes ``a`` and ``b``, say the rest: the calls of the two steps are paired in order (the same ops,
in the same order), and each pair is an :class:`Anchor`-to-anchor *line*:

* a pair whose signatures are equal does not depend on the batch: its measurement holds at any size;
* a pair whose signatures differ is a line in the batch size: every number of the signature (each
  size and stride) and every figure of the kernel memory (workspace, extra output bytes) goes from its
  value at ``a`` to its value at ``b`` along a line in the batch size. At size ``n``, a call whose
  signature lies on a pair's line -- each number exactly at ``n``'s point of its line -- gets the
  kernel memory at ``n``'s point of the pair's lines.

A call on no line (an op only one size runs) is left out: the hand model answers for it, as for any
call calibration did not measure. Kernels that switch algorithm with the batch size break the line
(oneDNN's backward convolution takes the larger of a weight-sized and a batch-sized buffer): the fit
is exact at both anchors and at every batch-independent signature, and approximate in between and
beyond: :meth:`BatchFit.workspace_bound` says how far off it may be, and the search measures the calls
where that could move the peak (``search/calibration.py``).

Example:
    >>> import torch
    >>> from lightning_memest.accounting.kernels.model import KernelMemory
    >>> sig = lambda n: f"aten.mm.default|cpu|T({n}, 64)(64, 1)float32;T(64, 8)(8, 1)float32"
    >>> a = Anchor(4, (sig(4),), {sig(4): KernelMemory(1000 + 4 * 256)})
    >>> b = Anchor(8, (sig(8),), {sig(8): KernelMemory(1000 + 8 * 256)})
    >>> fit = BatchFit.of(a, b)
    >>> fit.at(sig(100), 100)
    (True, KernelMemory(workspace_bytes=26600, workspace_after_outputs=True, extra_output_bytes=None))
    >>> fit.at(sig(100).replace("(64, 1)", "(1, 100)"), 100)[0]  # strides off the line: not known
    False
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lightning_memest.accounting.kernels.calibrate import Calibration, calibrated_calls, signature
from lightning_memest.accounting.kernels.model import KernelMemory
from lightning_memest.engine.simulate import Simulation

__all__ = ["Anchor", "BatchFit"]

#: The numbers of a signature (sizes, strides, integer arguments); what is between them is its skeleton.
_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Anchor:
    """A calibration at one batch size: the signature of each calibrated call in the order the step made
    them, and what each signature measured (``None``: nothing beyond its outputs)."""

    batch_size: int
    calls: tuple[str, ...]
    entries: Mapping[str, KernelMemory | None]

    @staticmethod
    def of(batch_size: int, sim: Simulation, calibration: Calibration) -> Anchor:
        calls = tuple(signature(c) for c in calibrated_calls(sim))
        return Anchor(batch_size, calls, dict(calibration.entries))


def _split(sig: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    return tuple(_NUMBER.split(sig)), tuple(int(m) for m in _NUMBER.findall(sig))


def _op(sig: str) -> str:
    return sig.split("|", 1)[0]


def _point(va: int, vb: int, na: int, nb: int, n: int) -> int:
    """The value at ``n`` of the line through ``(na, va)`` and ``(nb, vb)``, rounded, never negative."""
    return max(0, round((va * (nb - n) + vb * (n - na)) / (nb - na)))


def _outputs(km: KernelMemory | None, count: int) -> tuple[int, ...]:
    if km is None or km.extra_output_bytes is None:
        return (0,) * count
    return km.extra_output_bytes


def _workspace(km: KernelMemory | None) -> int:
    return 0 if km is None else km.workspace_bytes


def _between(p: int, kp: KernelMemory | None, q: int, kq: KernelMemory | None, n: int) -> KernelMemory | None:
    """The kernel memory at ``n`` on the lines through its figures at ``p`` and ``q``."""
    count = max(len(_outputs(kp, 0)), len(_outputs(kq, 0)))
    ep, eq = _outputs(kp, count), _outputs(kq, count)
    if len(ep) != len(eq):
        return kp if abs(n - p) <= abs(n - q) else kq  # one op's outputs do not change in number
    workspace = _point(_workspace(kp), _workspace(kq), p, q, n)
    extra = tuple(_point(x, y, p, q, n) for x, y in zip(ep, eq, strict=True))
    extra_bytes = extra if any(extra) else None
    if workspace == 0 and extra_bytes is None:
        return None
    return KernelMemory(workspace, True, extra_bytes)


@dataclass
class _Line:
    """One op signature's line in the batch size, and the kernel memory measured along it."""

    numbers: tuple[tuple[int, int], ...]
    """Each number of the signature at the two anchors."""
    points: dict[int, KernelMemory | None]
    """Kernel memory measured on the line, by batch size: the anchors, and probes the search measured."""

    def holds(self, numbers: tuple[int, ...], na: int, nb: int, n: int) -> bool:
        """Whether every number of a signature at ``n`` lies on its line (exact integer arithmetic)."""
        return len(numbers) == len(self.numbers) and all(
            x * (nb - na) == va * (nb - n) + vb * (n - na)
            for x, (va, vb) in zip(numbers, self.numbers, strict=True)
        )

    def _pair(self, n: int) -> tuple[int, int]:
        """The two measured sizes the figure at ``n`` comes from: the nearest on either side of it, or
        the two nearest where it is beyond them all."""
        sizes = sorted(self.points)
        below, above = [s for s in sizes if s < n], [s for s in sizes if s > n]
        if below and above:
            return below[-1], above[0]
        return (below[-2], below[-1]) if len(below) >= 2 else (above[0], above[1])

    def at(self, n: int) -> KernelMemory | None:
        if n in self.points:
            return self.points[n]
        p, q = self._pair(n)
        return _between(p, self.points[p], q, self.points[q], n)

    def bound(self, n: int, per_sample: int) -> int:
        """The most the workspace at ``n`` plausibly is. A workspace is the largest of a few buffers,
        each weight-sized or batch-sized, so it grows with the batch and bends upwards where a
        batch-sized buffer overtakes a weight-sized one (resnet18's backward convolutions, between
        batch 8 and 88). Between two measurements it is then below their chord (the fitted figure);
        below them all, at most the nearest; beyond them, the chord comes out low past a bend, so
        from the nearest measurement on it may grow by the steepest of the chord, the nearest
        measurement's own share per sample and ``per_sample`` (the bytes of the call's own tensors per
        sample: a batch-sized buffer the size of one of them)."""
        if n in self.points:
            return _workspace(self.points[n])
        p, q = self._pair(n)
        wp, wq = _workspace(self.points[p]), _workspace(self.points[q])
        line = _point(wp, wq, p, q, n)
        if p < n < q:
            return line
        if n < p:
            return max(line, wp)
        slope = max((wq - wp) / (q - p), wq / q, per_sample)
        return max(line, wq + int(slope * (n - q)))


@dataclass
class BatchFit:
    """Kernel memory at any batch size, from two :class:`Anchor` calibrations and what the search
    measures since (:meth:`add`); see the module's text."""

    na: int
    nb: int
    exact: dict[str, KernelMemory | None]
    """Signatures measured (at an anchor -- batch-independent ones hold at every size -- or later)."""
    lines: dict[tuple[str, ...], list[_Line]] = field(default_factory=dict)
    """Per signature skeleton, the lines of the pairs whose signatures differ."""

    @staticmethod
    def of(a: Anchor, b: Anchor) -> BatchFit:
        if a.batch_size == b.batch_size:
            raise ValueError(f"two anchors at different batch sizes are needed; got {a.batch_size} twice")
        exact = {**a.entries, **b.entries}
        lines: dict[tuple[str, ...], dict[tuple[tuple[int, int], ...], _Line]] = {}
        for sa, sb in _pairs(a.calls, b.calls):
            if sa == sb or sa not in a.entries or sb not in b.entries:
                continue
            (skeleton, xa), (skeleton_b, xb) = _split(sa), _split(sb)
            if skeleton != skeleton_b or len(xa) != len(xb):
                continue
            numbers = tuple(zip(xa, xb, strict=True))
            points = {a.batch_size: a.entries[sa], b.batch_size: b.entries[sb]}
            lines.setdefault(skeleton, {}).setdefault(numbers, _Line(numbers, points))
        return BatchFit(a.batch_size, b.batch_size, exact, {k: list(v.values()) for k, v in lines.items()})

    def _lines(self, sig: str, n: int) -> list[_Line]:
        skeleton, numbers = _split(sig)
        return [line for line in self.lines.get(skeleton, ()) if line.holds(numbers, self.na, self.nb, n)]

    def at(self, sig: str, n: int) -> tuple[bool, KernelMemory | None]:
        """``(found, kernel memory)`` of the signature ``sig`` of a call at batch size ``n``. Where two
        lines hold (they cross at ``n``), the larger memory: an estimate should not come out low."""
        if sig in self.exact:
            return True, self.exact[sig]
        found = [line.at(n) for line in self._lines(sig, n)]
        if not found:
            return False, None
        return True, max(found, key=_total)

    def workspace_bound(self, sig: str, n: int, per_sample: int = 0) -> int | None:
        """How large the workspace of ``sig`` at ``n`` plausibly is where it is fitted (``None``:
        measured, or on no line); ``per_sample``: the bytes of the call's tensors per sample (see
        ``_Line.bound``)."""
        if sig in self.exact:
            return None
        lines = self._lines(sig, n)
        return max(line.bound(n, per_sample) for line in lines) if lines else None

    def add(self, sig: str, n: int, km: KernelMemory | None) -> None:
        """What ``sig``, a signature at batch size ``n``, measured: exact from now on, and a point on
        its lines (so that ``n + 1``, the search's next probe, is fitted from next door)."""
        self.exact[sig] = km
        for line in self._lines(sig, n):
            line.points[n] = km

    def calibration(self, sim: Simulation, n: int, device: str) -> Calibration:
        """The fitted :class:`Calibration` of ``sim``, a step at batch size ``n``: every calibrated call
        on a line or measured (the others keep their hand models)."""
        entries: dict[str, KernelMemory | None] = {}
        for sig in dict.fromkeys(signature(c) for c in calibrated_calls(sim)):
            found, km = self.at(sig, n)
            if found:
                entries[sig] = km
        return Calibration(entries=entries, device=device, seconds=0.0, measured=0, cached=len(entries))


def _total(km: KernelMemory | None) -> int:
    return 0 if km is None else km.workspace_bytes + sum(km.extra_output_bytes or ())


def _pairs(a: tuple[str, ...], b: tuple[str, ...]) -> Iterable[tuple[str, str]]:
    """The calls of two steps paired in order: the longest runs of the same ops (a step that runs an op
    more at one size, a data-dependent branch, leaves its calls unpaired)."""
    ops_a, ops_b = [_op(s) for s in a], [_op(s) for s in b]
    matcher = difflib.SequenceMatcher(None, ops_a, ops_b, autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            yield a[block.a + k], b[block.b + k]
