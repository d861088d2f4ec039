"""``python -m lightning_memest.cli``: the ``memest`` command."""

import sys

from lightning_memest.cli import main

__all__: list[str] = []

sys.exit(main())
