"""8 simulated CPU devices for every test; must run before any JAX computation."""

import os

# Tests assert facts of the compiled HLO (collectives, FLOPs, buffer sizes) and numerics, not
# the speed of the generated CPU code, so skip LLVM's optimisation passes: compiling the suite
# takes about a third of the time. Benchmarks never set this.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"])
)

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
