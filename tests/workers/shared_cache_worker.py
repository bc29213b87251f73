"""One process of a job that compiles one program over every device and says whether its cache had it.

Prints "HITS <n> SUM <value>": the persistent-cache hits of this process for
that program, and its result. Run twice on one cache folder: the second time
every process, not only process 0, reads the program that process 0 wrote.
"""

import spmd

spmd.initialize()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

hits = []
jax.monitoring.register_event_listener(
  lambda event, **_: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
)
mesh = jax.make_mesh((jax.device_count(),), ("d",))
rows = jax.make_array_from_callback(
  (jax.device_count() * 2, 3),
  NamedSharding(mesh, P("d")),
  lambda index: jnp.arange(jax.device_count() * 6.0).reshape(-1, 3)[index],
)
before = len(hits)
total = jax.jit(lambda x: (x * x).sum(), out_shardings=NamedSharding(mesh, P()))(rows)
print(f"HITS {len(hits) - before} SUM {float(total.addressable_data(0))}", flush=True)
