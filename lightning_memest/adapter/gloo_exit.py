"""Before a CPU (gloo) rank exits: a moment with the GIL free for gloo's worker threads.

A gloo worker thread destroys each collective it ran when it is done with it. A collective issued
during a backward (DDP's gradient buckets) carries the thread-local state of that moment, and in it a
Python object (the ``contextvars`` context autograd stashes for every backward), whose destructor takes
the GIL. If the worker gets there only after the interpreter has begun to finalize, taking the GIL ends
the thread inside that destructor and the process aborts after training completed: "terminate called
without an active exception", SIGABRT. A PyTorch race, read from a core dump of a two-process CPU fit
(``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` ->
``gil_scoped_acquire`` -> ``pthread_exit`` -> ``std::terminate``, the main thread in ``Py_FinalizeEx``);
it hit 1 in 17 to 1 in 120 such fits on a loaded 2-core machine. ``atexit`` handlers run before the
interpreter finalizes: one that sleeps a moment gives a worker waiting for the GIL, or for a core, both.

Example (what the callbacks do at ``setup``)::

    settle_gloo_workers_at_exit()  # in a rank of a gloo process group; nothing elsewhere
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

__all__ = ["EXIT_PAUSE_SECONDS", "settle_gloo_workers_at_exit"]

#: How long the main thread sleeps at exit: a few scheduler periods of a loaded machine.
EXIT_PAUSE_SECONDS = 0.2

_registered = False


def settle_gloo_workers_at_exit() -> None:
    """Register, once per process, a pause at exit where this process is a rank of a gloo group."""
    global _registered
    if _registered or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() != "gloo" or dist.get_world_size() < 2:
        return
    _registered = True
    atexit.register(time.sleep, EXIT_PAUSE_SECONDS)
