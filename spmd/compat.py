"""The one place spmd-harness touches private names of JAX and orbax.

JAX and orbax may rename or remove anything under `jax._src`, a leading
underscore or an `experimental_` flag in any release. Each such name the
package needs is looked up here, once, when this module is imported, so that
a JAX the package was never run with fails at import with the name it lacks,
the version installed and the range to install, instead of deep inside a
multi-host run. Where a public API does the same job, it is the fallback, and
the package keeps working, perhaps a little slower:

| private name | used for | public fallback |
|---|---|---|
| `jax._src.array.ArrayImpl` | `sharded_jit`'s fast path: one type test per argument | `jax.Array` less tracers (`ConcreteArray`) |
| `ArrayImpl._sharding` | the same: the sharding without the property's frame | `x.sharding` |
| `jax._src.xla_bridge.backends_are_initialized` | "has JAX started its devices?" | JAX's own refusal to change `jax_num_cpu_devices` once started |
| `global_state.preemption_sync_manager` (`jax._src.distributed`) | whether JAX's preemption service runs | `jax.distributed.is_initialized()` and `jax_enable_preemption_service` |
| `global_state.client`, `.coordinator_address` | the coordination service's key-value store and barriers | none: required |
| `jax._src.clusters.ClusterEnv._cluster_types` | whether JAX recognises this cluster (TPU VM, SLURM, ...) | none: required |
| `jax._src.cloud_tpu_init.running_in_cloud_tpu_vm` | whether JAX took this machine for a Cloud TPU VM (its cluster detection then asks the GCE metadata server) | TPU chips in `/dev` (`accel*`, VFIO groups) and libtpu installed |
| `jax._src.cache_key._hash_accelerator_config` | CPU processes of one job read each other's programs from the persistent compilation cache (`share_cpu_programs_between_processes`) | none needed: each process but 0 compiles its programs at every start, as JAX does |
| splash's `splash_attention_mask._ComputableMask` | splash attention across `context` shards: a causal mask by each query's original place, computed in the kernel (`trainers.models.attention`) | XLA's attention across the shards; looked up when asked (`splash_lazy_mask_base`), since the launchers import `spmd` without Pallas |
| orbax's `experimental_orbax_use_distributed_barrier` flag | orbax's barriers as coordination-service calls | none: checked when the first checkpoint manager is made, since `spmd` does not import orbax |

Names are bound at import: the fast path's `isinstance(x, ARRAY_TYPE)` and
`sharding_of(x)` cost what the private names cost, with no call into this
module per dispatch.

Example:
  >>> import jax.numpy as jnp
  >>> x = jnp.ones(2)
  >>> isinstance(x, ARRAY_TYPE), sharding_of(x) is x.sharding
  (True, True)
  >>> backends_are_initialized()
  True
"""

from __future__ import annotations

import glob
import importlib
import importlib.metadata
import importlib.util
import operator
from collections.abc import Callable
from typing import Any

import jax

# Per distribution: the release the test suite has passed on, and the range
# setup.py requires (tests/test_compat.py checks that the two agree).
TESTED = {
  "jax": ("0.10.2", "jax>=0.10.2,<0.11"),
  "orbax-checkpoint": ("0.12.8", "orbax-checkpoint>=0.12.8,<0.13"),
}

ORBAX_BARRIER_FLAG = "experimental_orbax_use_distributed_barrier"


def installed_version(distribution: str) -> str:
  """The installed version of a distribution ("jax", "orbax-checkpoint"), or "none"."""
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return "none"


def missing(name: str, distribution: str = "jax") -> ImportError:
  """The error for a private name this package needs and the installed release lacks.

  >>> str(missing("jax._src.nothing.here"))  # doctest: +ELLIPSIS
  'spmd-harness needs jax._src.nothing.here (jax 0.10.2 has it); installed jax ... lacks it: install jax>=0.10.2,<0.11'
  """
  tested, requirement = TESTED[distribution]
  return ImportError(
    f"spmd-harness needs {name} ({distribution} {tested} has it); installed "
    f"{distribution} {installed_version(distribution)} lacks it: install {requirement}"
  )


def lookup(module: str, *attributes: str) -> Any | None:
  """`module.attr1.attr2...`, or None when this release lacks any part of it."""
  try:
    found = importlib.import_module(module)
  except ImportError:
    return None
  for attribute in attributes:
    found = getattr(found, attribute, None)
    if found is None:
      return None
  return found


def require(module: str, *attributes: str, find: Callable[..., Any] = lookup) -> Any:
  """Like `lookup`, but a missing name is `missing`'s ImportError."""
  found = find(module, *attributes)
  if found is None:
    raise missing(".".join((module, *attributes)))
  return found


class _ConcreteArrayMeta(type):
  def __instancecheck__(cls, x: Any) -> bool:
    # A tracer is a jax.Array too, but has no `.sharding`.
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


class ConcreteArray(metaclass=_ConcreteArrayMeta):
  """`isinstance(x, ConcreteArray)`: a `jax.Array` with data, not a tracer (public API only).

  >>> import jax.numpy as jnp
  >>> isinstance(jnp.ones(2), ConcreteArray), isinstance(2.0, ConcreteArray)
  (True, False)
  """


def array_type(find: Callable[..., Any] = lookup) -> type:
  """The class of JAX's arrays with data, for the fast path's type test."""
  return find("jax._src.array", "ArrayImpl") or ConcreteArray


def sharding_getter(cls: type) -> Callable[[Any], Any]:
  """Reads an array's sharding: `_sharding` where `cls` has it, else the public property."""
  return operator.attrgetter("_sharding" if hasattr(cls, "_sharding") else "sharding")


ARRAY_TYPE: type = array_type()
sharding_of: Callable[[Any], Any] = sharding_getter(ARRAY_TYPE)

_backends_are_initialized = lookup("jax._src.xla_bridge", "backends_are_initialized")


def backends_started_by_probe() -> bool:
  """Whether JAX's backends have started, asked through public API only.

  JAX validates `jax_num_cpu_devices` and refuses a new value once its
  backends have started; a refused change is the answer, an accepted one is
  put back at once.
  """
  current = jax.config.jax_num_cpu_devices
  try:
    jax.config.update("jax_num_cpu_devices", current + 1)
  except RuntimeError:
    return True
  jax.config.update("jax_num_cpu_devices", current)
  return False


def backends_are_initialized() -> bool:
  """Whether JAX has started its backends (devices can no longer be configured)."""
  if _backends_are_initialized is not None:
    return _backends_are_initialized()
  return backends_started_by_probe()


# The distributed runtime's state: a singleton `jax.distributed.initialize`
# fills in; its key-value client has no public handle.
_distributed_state = require("jax._src.distributed", "global_state")
for _field in ("client", "coordinator_address"):
  if not hasattr(_distributed_state, _field):
    raise missing(f"jax._src.distributed.global_state.{_field}")


def distributed_client() -> Any | None:
  """The coordination service's key-value client; None in a single process."""
  return _distributed_state.client


def coordinator_address() -> str | None:
  """The coordinator address `jax.distributed.initialize` connected to; None if not started."""
  return _distributed_state.coordinator_address


def preemption_service_running(state: Any = _distributed_state) -> bool:
  """Whether JAX's preemption sync manager runs (it catches SIGTERM across hosts)."""
  if hasattr(state, "preemption_sync_manager"):
    return state.preemption_sync_manager is not None
  # What jax.distributed.initialize decides by: it starts the service when
  # this option is on.
  return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)


_cluster_env = require("jax._src.clusters", "ClusterEnv")
for _field in ("_cluster_types", "opt_in_only_method", "is_env_present"):
  if not hasattr(_cluster_env, _field):
    raise missing(f"jax._src.clusters.ClusterEnv.{_field}")


def cluster_detected() -> bool:
  """True when JAX's own cluster detection (TPU VM, SLURM, Open MPI, ...) recognises this machine."""
  return any(
    env.is_env_present() for env in _cluster_env._cluster_types if not env.opt_in_only_method
  )


_cloud_tpu_init = lookup("jax._src.cloud_tpu_init")


def on_cloud_tpu_vm() -> bool:
  """Whether JAX took this machine for a Cloud TPU VM when it was imported.

  Then JAX's cluster detection treats it as one host of a TPU slice and asks
  the GCE metadata server for the slice's workers (`spmd.tpu_env` says why
  `spmd.initialize` reads the environment first).
  """
  flag = getattr(_cloud_tpu_init, "running_in_cloud_tpu_vm", None)
  if flag is not None:
    return bool(flag)
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")) and (
    importlib.util.find_spec("libtpu") is not None
  )


def use_coordination_service_barriers_in_orbax() -> None:
  """Makes orbax's barriers coordination-service calls (its experimental flag).

  Imports orbax, so it is checked here, when the trainer first needs it,
  rather than when `spmd` is imported.
  """
  import orbax.checkpoint  # noqa: F401  (defines the flag)
  from absl import flags

  if ORBAX_BARRIER_FLAG not in flags.FLAGS:
    raise missing(f"orbax's --{ORBAX_BARRIER_FLAG} flag", "orbax-checkpoint")
  if flags.FLAGS.is_parsed():
    setattr(flags.FLAGS, ORBAX_BARRIER_FLAG, True)
  else:  # used as a library: set it without parsing everyone's flags
    flags.FLAGS[ORBAX_BARRIER_FLAG].parse("true")


_cache_key_module = lookup("jax._src.cache_key")


def _cpu_model() -> str:
  """This machine's CPU features, which XLA:CPU compiles for (Linux's /proc/cpuinfo)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  import platform

  return platform.processor() or platform.machine()


def share_cpu_programs_between_processes(module: Any = None) -> bool:
  """Lets the CPU processes of one job read each other's programs from the persistent cache.

  JAX keys a cached program by, among others, the calling process's own
  topology. On CPU that is the process's local devices, so the processes of
  one job never share an entry, and as only process 0 writes the cache,
  every other process compiles every program at every start or restart, and
  the whole job waits for it. For a program on CPU devices this key takes
  the program's devices instead (global ids and processes, the same in every
  process) and the CPU features XLA compiles for, so processes on machines
  of one kind share, and others do not; other platforms keep JAX's key.
  Returns whether it applies (False where this JAX lacks the name).

  `module` stands for `jax._src.cache_key` (the default):

  >>> class CacheKeys:
  ...   _hash_accelerator_config = staticmethod(lambda hash_obj, devices: None)
  >>> share_cpu_programs_between_processes(CacheKeys), share_cpu_programs_between_processes(object())
  (True, False)
  """
  module = module if module is not None else _cache_key_module
  original = getattr(module, "_hash_accelerator_config", None)
  if original is None:
    return False
  if getattr(original, "spmd_keys_cpu_programs_by_devices", False):
    return True
  cpu_model = _cpu_model().encode()

  def hash_accelerator_config(hash_obj: Any, accelerators: Any) -> None:
    devices = list(accelerators.flat)
    if not devices or any(d.platform != "cpu" for d in devices):
      original(hash_obj, accelerators)
      return
    hash_obj.update(repr(sorted((d.id, d.process_index) for d in devices)).encode())
    hash_obj.update(cpu_model)

  hash_accelerator_config.spmd_keys_cpu_programs_by_devices = True
  module._hash_accelerator_config = hash_accelerator_config
  return True


SPLASH_MASKS = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask"


def splash_lazy_mask_base(find: Callable[..., Any] = lookup) -> type | None:
  """Splash's base class of masks computed inside the kernel, or None where this JAX lacks it.

  Without it, attention across `context` shards runs by XLA.
  """
  return find(SPLASH_MASKS, "_ComputableMask")
