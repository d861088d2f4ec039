"""Block replay: a run of alike blocks (a decoder's layers) simulated for its first instances, the rest
stood in for by their recorded events, the optimizer's per-parameter work for them too.

Where each concept lives: ``blocks.py`` (runs of alike blocks, their normalised event signature),
``block_replay.py`` (the stand-ins: which blocks run for real, which replay), ``block_templates.py``
(a recorded block's events and handles, renamed for a stand-in), ``stand_in_events.py`` (a
template's events emitted for one stand-in call, and the tensors it makes), ``replay_tracker.py``
(the tracker a replayed simulation runs with), ``optimizer_replay.py`` (torch.optim's for-loop updates
and state creation replayed for the stand-ins' parameters), ``optimizer_loops.py`` (the optimizer
loops' lists, marked where each parameter's iteration begins).
"""

__all__: list[str] = []
