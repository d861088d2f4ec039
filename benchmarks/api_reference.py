"""Write docs/api.md, the API reference, from the docstrings of the public names.

The public names are ``lightning_memest.__all__``, plus the modules the documents send scripts to
(:data:`MODULES`): for each, its signature and its docstring as written; for a class, its public
methods and properties too. Nothing is written by hand, so the page cannot drift from the code;
``tests/test_readme.py`` checks that the committed page is what this script writes now.

    python benchmarks/api_reference.py            # rewrite docs/api.md
    python benchmarks/api_reference.py --check    # exit 1 where docs/api.md is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"
#: Modules besides the package's face whose public names the documents give scripts.
MODULES = ("lightning_memest.measure", "lightning_memest.cases", "lightning_memest.fx")


def _signature(obj: Any) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # a default's repr names no address


def _doc(obj: Any) -> str:
    return inspect.getdoc(obj) or "(no docstring)"


def _member_lines(cls: type) -> list[str]:
    """A class's public methods and properties, each with the first paragraph of its docstring."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    lines = []
    # The class's own members and those of the package's classes it is made of (a mixin such as the
    # callback's loop hooks), the nearest first; not those of torch's or Lightning's bases.
    own: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        if base is cls or base.__module__.startswith("lightning_memest"):
            own.update(vars(base))
    for name, member in sorted(own.items()):
        if name.startswith("_") or name in fields:
            continue
        if isinstance(member, property):
            head = f"`{name}` (property)"
        elif isinstance(member, (staticmethod, classmethod)):
            head = f"`{name}{_signature(member.__func__)}`"
            member = member.__func__
        elif inspect.isfunction(member):
            head = f"`{name}{_signature(member)}`"
        else:
            continue
        first = _doc(member).split("\n\n")[0].replace("\n", " ")
        lines.append(f"- {head}: {first}")
    return lines


def _entry(module: str, name: str, obj: Any) -> list[str]:
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
    out = [f"### `{module}.{name}`", ""]
    if kind == "value":
        out += ["```text", f"{name} = {obj!r}", "```", ""]
        return out
    out += ["```text", f"{'class ' if kind == 'class' else ''}{name}{_signature(obj)}", "```", ""]
    out += ["```text", _doc(obj), "```", ""]  # as written (reST, doctests): not Markdown
    if kind == "class":
        members = _member_lines(obj)
        if members:
            out += ["Members:", "", *members, ""]
    return out


def page() -> str:
    """docs/api.md as this script writes it."""
    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `python benchmarks/api_reference.py`; do not edit by hand.",
        "The names of `lightning_memest` first, then those of the modules scripts use.",
        "",
    ]
    for module in ("lightning_memest", *MODULES):
        mod = importlib.import_module(module)
        out += [f"## `{module}`", "", (inspect.getdoc(mod) or "").split("\n\n")[0], ""]
        for name in mod.__all__:
            obj = getattr(mod, name)
            if module != "lightning_memest" and getattr(obj, "__module__", module) != module:
                continue  # given by the package's face already, or imported from elsewhere
            out += _entry(module, name, obj)
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 if stale")
    args = parser.parse_args()
    text = page()
    if args.check:
        stale = not PAGE.exists() or PAGE.read_text() != text
        print(f"{PAGE.relative_to(ROOT)} is {'stale' if stale else 'up to date'}", file=sys.stderr)
        return 1 if stale else 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
