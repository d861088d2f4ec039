"""The engine: runs training steps on fake tensors and emits one event stream; it knows nothing of
Lightning, accounting, reports or printing.

Where each concept lives: ``events.py`` (the event vocabulary, ``Phase``), ``fake.py`` (modules and
batches to fake tensors and back), ``tracker.py`` (the dispatch mode: storage lifetimes, phases ->
events), ``hooks.py`` (module scopes, saved tensors, storage resizes, told to the tracker),
``data_dependent.py`` (a policy for every data-dependent op), ``value_sets.py`` (the values an integer
tensor can hold; their rules per op in ``value_set_rules.py`` and ``elementwise_sets.py``),
``nonzero_bounds.py`` (how many elements a mask can select, at most),
``tensor_facts.py`` (what is known of a tensor's values, tied to its storage's writes),
``assumed_values.py`` (what an unknown value is assumed not to equal, for upper bounds),
``read_guard.py`` (a cap on reads of assumed values per call site: no simulated loop spins forever),
``pointer_kernels.py`` (kernels that write through data pointers, in Python),
``step.py`` (``StepConfig`` and the plain step runner), ``inference_step.py`` (a validation or
predict batch of a plain model), ``containers.py`` (the module's containers put back after a fake
run), ``autograd_threads.py`` (autograd's device threads settled before the first fake backward),
``collector.py`` (Python's full garbage collections wait during a simulation),
``simulate.py`` (the entry point),
``distributed.py`` (DDP/FSDP on a fake process group), ``cuda_autocast.py`` (CUDA's autocast op lists,
for what-ifs), ``real_path.py`` (libraries' tracing checks answered as in a real eager run; the known
values of small integer and boolean tensors; the CPU generator's state copies).
"""

__all__: list[str] = []
