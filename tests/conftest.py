"""8 simulated CPU devices for every test; must run before any JAX computation."""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
