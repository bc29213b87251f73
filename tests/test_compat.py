"""spmd.compat: the only module that touches private JAX and orbax names.

Each public fallback runs for real with the private name made absent, a
missing name without a fallback fails at import naming the name, the
installed version and the range to install, setup.py's bounds match what
compat names, and no other module of the package reaches a private name.
"""

import ast
import hashlib
import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from spmd import compat
from spmd._jit import fast_path
from spmd.partition import PartitionSpec as P
from tests.multiprocess import assert_ok, run_worker

# The module (the package's `spmd.sharded_jit` is the function it exports).
sharded_jit = importlib.import_module("spmd.sharded_jit")
ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("spmd", "trainers", "launch", "configs")
ALLOWED = {Path("spmd/compat.py")}

# Attributes and absl flags that are JAX's or orbax's internals wherever they
# are read; compat.py's table lists each one.
PRIVATE_ATTRIBUTES = {
  "_sharding",
  "_cluster_types",
  "global_state",
  "preemption_sync_manager",
  "backends_are_initialized",
  "xla_bridge",
  "ArrayImpl",
}
PRIVATE_STRINGS = ("experimental_orbax_", "jax._src")
THIRD_PARTY = ("jax", "jaxlib", "orbax", "flax", "optax")


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", textwrap.dedent(code)],
    capture_output=True,
    text=True,
    timeout=timeout,
    cwd=ROOT,
    env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
  )


# -- the fast path's fallback ----------------------------------------------------


@pytest.fixture
def public_fast_path(monkeypatch):
  """The fast path as it runs on a JAX without `ArrayImpl` or `_sharding`."""
  array_type = compat.array_type(find=lambda *names: None)
  getter = compat.sharding_getter(array_type)
  assert array_type is compat.ConcreteArray
  assert getter(_Sharded()) == "public"
  for module in (fast_path, sharded_jit):  # the names they bound at import
    monkeypatch.setattr(module, "ARRAY_TYPE", array_type)
    monkeypatch.setattr(module, "sharding_of", getter)


class _Sharded:
  sharding = "public"


def test_the_tested_jax_gets_the_private_names_bound_at_import():
  assert compat.ARRAY_TYPE is compat.lookup("jax._src.array", "ArrayImpl")
  assert compat.ARRAY_TYPE is not compat.ConcreteArray
  assert fast_path.ARRAY_TYPE is sharded_jit.ARRAY_TYPE is compat.ARRAY_TYPE
  assert fast_path.sharding_of is sharded_jit.sharding_of is compat.sharding_of
  x = jax.numpy.ones(2)
  assert compat.sharding_of(x) is x.sharding


def test_sharding_getter_falls_back_to_the_public_property():
  assert compat.sharding_getter(_Sharded)(_Sharded()) == "public"
  assert compat.sharding_getter(compat.ConcreteArray)(_Sharded()) == "public"


def test_fast_path_runs_on_public_names(public_fast_path):
  f = sharded_jit.sharded_jit(lambda x: x * 2, in_parts=P(2), out_parts=P(2))
  y = f(np.arange(4.0))  # the first call takes the full path and builds the fast one
  impl = f.sharded_jit
  assert impl.fast is not None

  def full_path(args, kwargs):
    raise AssertionError(f"took the full path for {args}")

  with pytest.MonkeyPatch.context() as m:
    m.setattr(impl, "call", full_path)
    assert f(y).tolist() == [0.0, 4.0, 8.0, 12.0]  # one array on the plan's sharding
    assert impl.fast.admits((y,))
  # A tracer is a jax.Array without `.sharding`: the fallback's type test
  # leaves it to the leaf-by-leaf test instead of failing on it.
  grad = jax.grad(lambda v: f(v).sum())(y)
  assert grad.tolist() == [2.0] * 4
  # An array on other devices is not admitted; the full path moves it.
  elsewhere = jax.device_put(np.arange(4.0), jax.devices()[5])
  assert not impl.fast.admits((elsewhere,))
  assert f(elsewhere).tolist() == [0.0, 2.0, 4.0, 6.0]


def test_fast_path_fallback_admits_two_arguments_leaf_by_leaf(public_fast_path):
  f = sharded_jit.sharded_jit(lambda a, b: a + b, in_parts=(P(2), None), out_parts=P(2))
  a, b = np.arange(4.0), np.ones(4)
  f(a, b)
  placed = jax.device_put(a, f.sharded_jit.fast._plan.in_leaves[0].sharding)
  assert f.sharded_jit.fast.admits((placed, b))
  assert f(placed, b).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_concrete_array_excludes_tracers():
  seen = []

  def f(v):
    seen.append(isinstance(v, compat.ConcreteArray))
    return v.sum()

  jax.grad(f)(jax.numpy.ones(2))
  jax.jit(f)(jax.numpy.ones(2))
  assert seen == [False, False]
  assert isinstance(jax.numpy.ones(2), compat.ConcreteArray)
  assert not isinstance(np.ones(2), compat.ConcreteArray)


# -- the other fallbacks ----------------------------------------------------------


@pytest.mark.multiprocess
def test_backends_probe_agrees_and_serves_set_cpu_device_count():
  """In a fresh process: the public probe answers as JAX's private function does."""
  out = _run(
    """
    import json, jax
    from spmd import compat, distributed
    answers = [(compat.backends_started_by_probe(), compat.backends_are_initialized())]
    compat._backends_are_initialized = None  # the fallback from here on
    distributed.set_cpu_device_count(3)
    value = jax.config.jax_num_cpu_devices
    n = jax.device_count()
    answers.append((compat.backends_started_by_probe(), compat.backends_are_initialized()))
    try:
      distributed.set_cpu_device_count(5)
      error = None
    except RuntimeError as e:
      error = str(e)
    print(json.dumps(dict(answers=answers, value=value, n=n, after=jax.config.jax_num_cpu_devices, error=error)))
    """
  )
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["answers"] == [[False, False], [True, True]]
  assert got["value"] == got["after"] == 3 and got["n"] == 3  # the probe changed nothing
  assert "already started with 3 CPU devices" in got["error"]


def test_preemption_fallback_in_one_process():
  assert compat.preemption_service_running() is False
  assert compat.preemption_service_running(state=object()) is False


@pytest.mark.multiprocess
def test_distributed_names_and_fallbacks_on_two_processes():
  result = run_worker("compat_worker", num_processes=2, devices_per_process=1, timeout_s=120)
  assert_ok(result)
  for p in result.processes:
    for check in ("client", "initialize twice", "preemption service"):
      assert f"PASS {check}\n" in p.output, result.report()


@pytest.mark.multiprocess
def test_every_cpu_process_reads_what_process_0_compiled(tmp_path):
  """JAX keys a CPU program by the calling process's own devices; ours by the program's."""
  env = {
    "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }
  runs = []
  for _ in range(2):
    result = run_worker(
      "shared_cache_worker", num_processes=2, devices_per_process=2, timeout_s=120, env=env
    )
    assert_ok(result)
    runs.append([p.output.split("HITS ")[1].split() for p in result.processes])
  expected = str(float(sum(v * v for v in range(24))))
  # Process 0 compiles in the first job; process 1 compiles too, or reads
  # process 0's entry when it gets there after the write (a loaded machine).
  assert runs[0][0][0] == "0" and runs[0][1][0] in ("0", "1"), runs
  assert [hits for hits, _, _ in runs[1]] == ["1", "1"], runs
  assert {total for run in runs for _, _, total in run} == {expected}, runs


def test_cpu_programs_keep_jax_keys_elsewhere_and_without_the_name():
  seen = []

  class Device:
    def __init__(self, platform, id):
      self.platform, self.id, self.process_index = platform, id, id // 2

  class CacheKeys:  # the part of jax._src.cache_key it replaces
    @staticmethod
    def _hash_accelerator_config(hash_obj, accelerators):
      seen.append([d.platform for d in accelerators.flat])

  keys = CacheKeys()
  assert compat.share_cpu_programs_between_processes(keys)
  assert compat.share_cpu_programs_between_processes(keys)  # once is enough
  on = lambda platform: np.array([Device(platform, i) for i in range(4)])  # noqa: E731
  cpu_hashes = []
  for ids in (range(4), range(4), range(1, 5)):
    h = hashlib.sha256()
    keys._hash_accelerator_config(h, np.array([Device("cpu", i) for i in ids]))
    cpu_hashes.append(h.hexdigest())
  keys._hash_accelerator_config(hashlib.sha256(), on("tpu"))
  assert seen == [["tpu"] * 4]  # JAX's own key for other platforms
  assert cpu_hashes[0] == cpu_hashes[1] != cpu_hashes[2]  # the program's devices decide
  assert compat.share_cpu_programs_between_processes(object()) is False


# -- names without a fallback ------------------------------------------------------


def test_require_names_the_missing_name_version_and_range():
  with pytest.raises(ImportError) as e:
    compat.require("jax._src.distributed", "global_state", find=lambda *names: None)
  assert str(e.value) == (
    "spmd-harness needs jax._src.distributed.global_state (jax 0.10.2 has it); installed "
    f"jax {jax.__version__} lacks it: install jax>=0.10.2,<0.11"
  )
  assert compat.lookup("jax._src.no_such_module", "x") is None
  assert compat.lookup("jax._src.distributed", "no_such_name") is None


@pytest.mark.multiprocess
def test_a_missing_private_name_fails_at_import():
  """With each required name removed from JAX (and orbax's flag), importing says which."""
  out = _run(
    """
    import importlib, json, sys
    import jax._src.clusters as clusters
    import jax._src.distributed as jd
    from absl import flags

    def import_error(module="spmd.distributed"):
      for name in [m for m in sys.modules if m == "spmd" or m.startswith(("spmd.", "trainers"))]:
        del sys.modules[name]
      try:
        importlib.import_module(module)
      except ImportError as e:
        return str(e)
      return None

    found = {}
    state = jd.global_state
    del jd.global_state
    found["global_state"] = import_error()
    jd.global_state = state
    types = clusters.ClusterEnv._cluster_types
    del clusters.ClusterEnv._cluster_types
    found["cluster_types"] = import_error()
    clusters.ClusterEnv._cluster_types = types
    found["nothing missing"] = import_error()
    import orbax.checkpoint
    from spmd import compat
    delattr(flags.FLAGS, compat.ORBAX_BARRIER_FLAG)
    try:
      compat.use_coordination_service_barriers_in_orbax()
    except ImportError as e:
      found["orbax flag"] = str(e)
    print(json.dumps(found))
    """
  )
  assert out.returncode == 0, out.stderr[-3000:]
  found = json.loads(out.stdout.strip().splitlines()[-1])
  installed = f"installed jax {jax.__version__} lacks it: install jax>=0.10.2,<0.11"
  assert found["global_state"] == (
    f"spmd-harness needs jax._src.distributed.global_state (jax 0.10.2 has it); {installed}"
  )
  assert found["cluster_types"] == (
    f"spmd-harness needs jax._src.clusters.ClusterEnv._cluster_types (jax 0.10.2 has it); {installed}"
  )
  assert found["nothing missing"] is None
  orbax = compat.installed_version("orbax-checkpoint")
  assert found["orbax flag"] == (
    "spmd-harness needs orbax's --experimental_orbax_use_distributed_barrier flag "
    f"(orbax-checkpoint 0.12.8 has it); installed orbax-checkpoint {orbax} lacks it: "
    "install orbax-checkpoint>=0.12.8,<0.13"
  )


# -- version bounds -------------------------------------------------------------


def _setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
  tree = ast.parse((ROOT / "setup.py").read_text())
  call = next(
    n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "setup"
  )
  keywords = {
    k.arg: ast.literal_eval(k.value)
    for k in call.keywords
    if k.arg in ("install_requires", "extras_require")
  }
  return keywords["install_requires"], keywords["extras_require"]


def test_setup_bounds_are_what_compat_names():
  requires, extras = _setup_requirements()
  jax_tested, jax_range = compat.TESTED["jax"]
  orbax_tested, orbax_range = compat.TESTED["orbax-checkpoint"]
  assert jax_range in requires
  assert jax_range.replace("jax", "jaxlib", 1) in requires
  assert orbax_range in requires
  assert any(r.startswith("flax>=") and ",<" in r for r in requires), requires
  assert extras["tpu"] == [jax_range.replace("jax", "jax[tpu]", 1)]
  assert extras["cuda"] == [jax_range.replace("jax", "jax[cuda12]", 1)]
  # The installed releases are inside the ranges (the suite runs on them).
  assert compat.installed_version("jax") == jax_tested
  assert compat.installed_version("orbax-checkpoint") == orbax_tested


# -- no private names elsewhere ------------------------------------------------------


def private_uses(source: str) -> list[str]:
  """Each place `source` imports or reads a private JAX/orbax/flax name."""
  found = []
  tree = ast.parse(source)
  third_party_names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] in THIRD_PARTY:
          third_party_names.add((alias.asname or alias.name).split(".")[0])
    elif isinstance(node, ast.ImportFrom) and node.module:
      if node.module.split(".")[0] in THIRD_PARTY:
        third_party_names.update(a.asname or a.name for a in node.names)
  for node in ast.walk(tree):
    where = f"line {getattr(node, 'lineno', '?')}"
    if isinstance(node, ast.Import | ast.ImportFrom):
      modules = (
        [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
      )
      if isinstance(node, ast.ImportFrom):
        modules += [f"{node.module}.{a.name}" for a in node.names]
      for module in modules:
        parts = module.split(".")
        private = [p for p in parts if p.startswith("_") and not p.startswith("__")]
        internals = parts[:2] == ["jax", "lib"] or (parts[0] == "jaxlib" and len(parts) > 1)
        if parts[0] in THIRD_PARTY and (private or internals):
          found.append(f"{where}: imports {module}")
    elif isinstance(node, ast.Attribute):
      if node.attr in PRIVATE_ATTRIBUTES and ast.unparse(node.value) != "compat":
        found.append(f"{where}: reads .{node.attr}")
      elif node.attr.startswith("_") and not node.attr.startswith("__"):
        root = node.value
        while isinstance(root, ast.Attribute):
          root = root.value
        if isinstance(root, ast.Name) and root.id in third_party_names:
          found.append(f"{where}: reads {ast.unparse(node)}")
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      named = node.value in PRIVATE_ATTRIBUTES or any(s in node.value for s in PRIVATE_STRINGS)
      if named and not _is_docstring(node, tree):
        found.append(f"{where}: names {node.value!r}")
  return found


def _is_docstring(node: ast.Constant, tree: ast.Module) -> bool:
  for owner in ast.walk(tree):
    if isinstance(owner, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
      body = owner.body
      if body and isinstance(body[0], ast.Expr) and body[0].value is node:
        return True
  return False


def test_the_scan_finds_each_kind_of_private_use():
  source = textwrap.dedent(
    """
    import jax
    import jaxlib.xla_client
    import orbax.checkpoint as ocp
    from jax._src.array import ArrayImpl
    from jax._src import xla_bridge
    from flax.nnx import _private_helper
    def f(x, flags):
      flags.FLAGS["experimental_orbax_use_distributed_barrier"].parse("true")
      getattr(x, "_sharding")
      ocp._internal.thing()
      return x._sharding, jax._src.distributed.global_state
    """
  )
  found = private_uses(source)
  for expected in (
    "imports jaxlib.xla_client",
    "imports jax._src.array",
    "imports jax._src.xla_bridge",
    "imports flax.nnx._private_helper",
    "names 'experimental_orbax_use_distributed_barrier'",
    "reads ocp._internal",
    "reads ._sharding",
    "reads .global_state",
    "reads jax._src",
    "names '_sharding'",
  ):
    assert any(expected in f for f in found), (expected, found)
  assert private_uses("import jaxlib\nimport jax\nx = jax.numpy.ones(2).sharding\n") == []


def test_no_module_but_compat_reaches_a_private_name():
  offenders = {}
  for directory in PACKAGE_DIRS:
    for path in sorted((ROOT / directory).rglob("*.py")):
      relative = path.relative_to(ROOT)
      if relative in ALLOWED:
        continue
      uses = private_uses(path.read_text(encoding="utf-8"))
      if uses:
        offenders[str(relative)] = uses
  assert not offenders, (
    f"private JAX/orbax names outside spmd/compat.py (add them there, with a fallback): {offenders}"
  )
