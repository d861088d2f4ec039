"""Compiled steps: what ``torch.compile`` compiled, and running it compiled on fake tensors.

``modules`` names the compiled modules and runs them eagerly where asked; ``dynamo_state`` lets dynamo
compile inside a simulation and leaves its caches, counters and shape profiles as they were;
``fake_graphs`` runs the code inductor generated on fake tensors, its kernels left out, so its buffers
are allocated, reused and freed as the real run's are.
"""

from lightning_memest.engine.compiled.dynamo_state import CompileRecord, compile_failure, simulated_compiles
from lightning_memest.engine.compiled.fake_graphs import inductor_graphs_on_fake
from lightning_memest.engine.compiled.modules import compiled_modules, eager_compiled, inside_compiled

__all__ = [
    "CompileRecord",
    "compile_failure",
    "compiled_modules",
    "eager_compiled",
    "inductor_graphs_on_fake",
    "inside_compiled",
    "simulated_compiles",
]
