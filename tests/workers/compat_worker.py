"""One process of a job that checks spmd.compat's distributed answers against JAX's own.

Prints "PASS <check>" for each check that held; any failure raises.
"""

import spmd

info = spmd.initialize()
import jax  # noqa: E402

from spmd import compat  # noqa: E402
from trainers.run.preemption import PreemptionWatch  # noqa: E402

assert jax.process_count() == 2, jax.process_count()
assert compat.distributed_client() is not None
print("PASS client", flush=True)

# A second initialize is a no-op that reports the same coordinator.
again = spmd.initialize()
assert again.coordinator_address == info.coordinator_address is not None, (again, info)
assert compat.coordinator_address() == info.coordinator_address
print("PASS initialize twice", flush=True)

# JAX started its preemption service; the private answer and the public
# fallback (a state without the private field) both say so.
assert compat.preemption_service_running() is True
assert compat.preemption_service_running(state=object()) is True
watch = PreemptionWatch()
assert watch._distributed and not watch.reached(0)
watch.close()
print("PASS preemption service", flush=True)
