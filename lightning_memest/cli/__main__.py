"""``python -m lightning_memest.cli``: the ``memest`` command."""

import os
import sys

from lightning_memest.cli import main

__all__: list[str] = []

# `python -m` put the current directory first on sys.path; `memest` keeps it last, so that a file there
# (a torchvision.py beside the model) never shadows an installed package. The same here.
if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] == os.getcwd():
    sys.path.append(sys.path.pop(0))

sys.exit(main())
