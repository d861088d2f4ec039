"""Every docstring example of the package runs and shows what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lightning_memest

# ``__main__`` modules run their command when imported.
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(lightning_memest.__path__, prefix="lightning_memest.")
    if not m.name.endswith(".__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
