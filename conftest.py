"""Every test process sees 8 CPU devices, set before JAX starts its backend."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# Scripts that run as their own processes, not test modules.
collect_ignore_glob = ["tests/workers/*", "examples/*", "benchmarks/*"]
