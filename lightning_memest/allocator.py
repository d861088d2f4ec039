"""The public home of the allocator models (``from lightning_memest.allocator import CudaCachingAllocator``).

The model itself lives with the rest of the accounting, in ``accounting/cuda_allocator.py``.
"""

from lightning_memest.accounting.cuda_allocator import CudaCachingAllocator

__all__ = ["CudaCachingAllocator"]
