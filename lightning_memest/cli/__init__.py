"""``memest``: estimate, measure and compare the memory of one training step from the command line.

::

    memest estimate MODEL [--model-kwargs JSON] [--batch-size N]
                    (--input-shape C,H,W | --tokens SEQ --vocab V)
                    [--loss cross_entropy|sum] [--optimizer sgd|adam|adamw|none]
                    [--precision 32-true|16-mixed|bf16-mixed|16-true|bf16-true] [--device cpu|cuda] [--json]
    memest measure  (the same arguments)
    memest compare MODEL [MODEL ...] (the same input, loss, optimizer, precision and device flags) [--json]
    memest max-batch-size MODEL --memory-budget SIZE (the flags of estimate) [--max-batch-size N]

``max-batch-size`` prints the largest batch size whose estimated peak is within SIZE (bytes, or a
number with a unit: ``10GiB``, ``512MiB``, ``1.5GB``, ``8g``; see
:func:`~lightning_memest.budget.parse_size`); the search starts at the smallest batch size the step
accepts (1, else 2, 4, ...) and ``--batch-size`` is the second size it probes. With ``--json``:
``{"max_batch_size": int, "peak_bytes_at_max": int | null, "probes": int, "seconds": float,
"smallest": int, "approximate": bool}`` (``max_batch_size`` 0 and ``peak_bytes_at_max`` null when not
even the smallest batch fits: still exit 0, with a note on stderr).

``compare`` runs each model on its own: a model that fails gets its reason in its row (``"error"`` in
the JSON) and the others still run; it exits 2 only when every model failed.

Every JSON value has ``"approximate"`` (a CUDA what-if on a machine without a GPU). Long work shows
one line of progress on stderr when stderr is a terminal and the output is not ``--json``;
``memest --version`` prints the releases in use.

``MODEL`` is ``package.module:name``, imported and called: it runs that code, as ``python -m`` does.
The current directory is importable, after the installed packages (a ``torchvision.py`` there does not
shadow torchvision); see :mod:`lightning_memest.cases` for how models, inputs, losses and optimizers
are made.

``--help``, ``--version`` and a usage error import no torch (seconds): the parser is torch-free, and
the command imports the library only once its arguments are read.

Exit status: 0 on success; 2 on bad input (an unknown model, a bad flag, an input the model rejects)
and when the estimator cannot simulate the step (:class:`~lightning_memest.errors.MemestError`), with
one ``memest: error: ...`` line on stderr; 1 on an unexpected failure (set ``MEMEST_DEBUG=1`` for its
traceback).

Example:
    >>> main(["estimate", "torch.nn:Linear", "--model-kwargs", '{"in_features": 8, "out_features": 4}',
    ...       "--input-shape", "8", "--json"])  # doctest: +SKIP
    {"peak_bytes": {"first_step": ..., "steady_state": ...}, ...}
    0
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from lightning_memest.cli.parser import PROG, build_parser
from lightning_memest.cli.settings import settings as checked_settings
from lightning_memest.errors import MemestError, one_line

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``memest`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Example:
        >>> main(["measure", "torch.nn:Linear", "--model-kwargs", '{"in_features": 8, "out_features": 4}',
        ...       "--input-shape", "8", "--json"])  # doctest: +ELLIPSIS
        {"peak_bytes": {"first_step": ..., "steady_state": ...}, "reserved_bytes": null, "step_seconds": ...}
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help exits 0, usage errors 2; return rather than exit when called in-process
        return e.code if isinstance(e.code, int) else 2
    # `memest estimate mymodel:Net` run from a project directory should find mymodel.py there; the
    # console script's sys.path does not hold the current directory. Last, so that a file there never
    # shadows an installed package (a torchvision.py beside the model).
    # (The profiler's own chatter on stderr is silenced where the library starts it: allocator_events.)
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        from lightning_memest.cli.commands import COMMANDS  # the library, torch with it

        COMMANDS[args.command](checked_settings(args), sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`memest ... | head`): nothing left to say, as any Unix tool.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except MemestError as e:
        if os.environ.get("MEMEST_DEBUG"):
            raise
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("MEMEST_DEBUG"):
            raise
        print(
            f"{PROG}: error: unexpected {type(e).__name__}: {one_line(e)}"
            " (set MEMEST_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        # Called in-process (tests, scripts), leave the import path as it was.
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
