"""The engine: runs training steps on fake tensors and emits one event stream; it knows nothing of
Lightning, accounting, reports or printing.

Where each concept lives: ``events.py`` (the event vocabulary, ``Phase``), ``fake.py`` (modules and
batches to fake tensors and back), ``tracker.py`` (storage lifetimes, phases -> events),
``tracking_mode.py`` (the fake dispatch mode that reports each op to the tracker), ``hooks.py``
(module scopes, saved tensors, storage resizes, told to the tracker), ``values/`` (what is known of
values never computed: data-dependent ops, value sets, selection bounds), ``pointer_kernels.py``
(kernels that write through data pointers, in Python), ``step.py`` (``StepConfig`` and the plain step
runner), ``inference_step.py`` (a validation or predict batch of a plain model), ``containers.py`` (the
module's containers put back after a fake run), ``autograd_threads.py`` (autograd's device threads
settled before the first fake backward), ``collector.py`` (Python's full garbage collections wait
during a simulation), ``simulate.py`` (the entry point), ``replay/`` (repeated blocks simulated once,
replayed for the rest), ``distributed.py`` (DDP/FSDP on a fake process group), ``cuda_autocast.py``
(CUDA's autocast op lists, for what-ifs), ``cuda_paths.py`` (CUDA's branch where a composite op
branches on the device), ``real_path.py`` (libraries' tracing checks answered as in a real eager run;
the known values of small integer and boolean tensors; the CPU generator's state copies),
``real_ops.py`` (an op whose fake kernel fails, run for real on stand-ins), ``sparse.py`` (sparse COO
tensors on fake tensors).
"""

__all__: list[str] = []
