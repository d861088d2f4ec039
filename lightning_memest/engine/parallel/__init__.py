"""One rank of a parallel job, simulated with PyTorch's own code on fake process groups.

``distributed.py`` holds the strategies (DDP, FSDP2, tensor parallelism on 1-D and 2-D meshes), the
fake groups of a strategy and :func:`~lightning_memest.engine.parallel.distributed.wrap`;
``fake_groups.py`` makes and registers those groups and keeps meshes and caches apart from real
ones; ``arrived.py`` reads back a module that arrived parallelised (Lightning's
``ModelParallelStrategy``) as a strategy that redoes it; ``plans.py`` builds 2-D plans from parts (the
CLI's ``--tp`` with ``--strategy fsdp``); ``meta_init.py`` initialises a meta-device model as large
jobs do (only the shards ever exist); ``pipeline.py`` cuts a rank's pipeline stages and runs
PyTorch's schedules on them.
"""
