"""What a simulation knows of tensor values it never computes: the policy for each data-dependent op,
the values an integer tensor can hold, bounds on how many elements a mask selects.

Where each concept lives: ``data_dependent.py`` (a policy for every data-dependent op),
``value_sets.py`` (the values an integer tensor can hold; their rules per op in ``value_set_rules.py``
and ``elementwise_sets.py``), ``nonzero_bounds.py`` (how many elements a mask can select, at most),
``router_shares.py`` (a router's picks shared among the experts that select them),
``tensor_facts.py`` (what is known of a tensor's values, tied to its storage's writes),
``assumed_values.py`` (what an unknown value is assumed not to equal, for upper bounds),
``read_guard.py`` (a cap on reads of assumed values per call site: no simulated loop spins forever),
``followed_values.py`` (a step that failed after assumed reads, simulated again on its values).
"""

__all__: list[str] = []
