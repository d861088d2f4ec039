"""The ``memest`` argument parser: the command's name, its ``--version`` and its subcommands (each
one's flags: ``subcommands.py``; their values: ``flag_values.py``; checked together into
:class:`~lightning_memest.cli.settings.Settings`: ``settings.py``).

Building and running the parser imports no torch (its choices and defaults come from
:mod:`lightning_memest.constants`): ``memest --help``, ``--version`` and a usage error answer at once.

Example:
    >>> build_parser().parse_args(["estimate", "torch.nn:Linear", "--input-shape", "8"]).batch_size
    8
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from lightning_memest.cli.subcommands import (
    add_compare_parser,
    add_estimate_parsers,
    add_max_batch_size_parser,
    add_plan_parser,
    add_profile_parser,
)

__all__ = ["PROG", "build_parser", "version"]

PROG = "memest"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``memest: error: ...``), like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


def version() -> str:
    """``memest --version``: this package's release and the releases it runs with (for bug reports),
    read from the installed packages' metadata: importing torch and Lightning would take seconds."""
    import platform

    import lightning_memest

    return (
        f"{PROG} {lightning_memest.__version__} (torch {_torch_release()}, lightning "
        f"{_installed('lightning')}, Python {platform.python_version()})"
    )


def _installed(distribution: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_release() -> str:
    """torch's release as ``torch.__version__`` gives it (``2.14.1+cu130``: the metadata drops the
    build's ``+cu130``), read from ``torch/version.py`` without importing torch."""
    import importlib.metadata
    import re
    from pathlib import Path

    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    try:
        text = Path(str(dist.locate_file("torch/version.py"))).read_text()
    except OSError:
        text = ""
    match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else dist.version


class _Version(argparse.Action):
    """``--version``: its text is made only when asked for (it reads the installed packages' metadata)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "show the releases in use and exit")
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        print(version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The ``memest`` argument parser."""
    parser = _Parser(
        prog=PROG,
        description="Estimate the memory of one PyTorch training step on fake tensors; measure it for real.",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{estimate,measure,compare,profile,max-batch-size,plan}"
    )
    add_estimate_parsers(sub)
    add_compare_parser(sub)
    add_max_batch_size_parser(sub)
    add_profile_parser(sub)
    add_plan_parser(sub)
    return parser
