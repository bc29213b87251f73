"""No train step makes XLA copy whole arrays: every rules preset, four meshes, CPU and TPU HLO.

XLA's SPMD partitioner prints "Involuntary full rematerialization" when it
cannot reach a sharding cheaply and replicates the whole array on every
device instead. Equal losses cannot show that (the copy computes the same
numbers), so these tests read the compiler's log: XLA:CPU writes it to file
descriptor 2, libtpu to its log folder (`spmd.compiler_log` reads both), with
the persistent compilation cache off, since a cache hit compiles nothing.
Each check first proves it can see a fallback, on a program made to have one.

The steps are `trainers.step.train_step.make_train_step`'s, the trainer's own, for the
Llama (layers scanned) and the transformer (unrolled) at tiny shapes whose
head counts divide 4, on packed rows (token and position lookups both).
"""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import llama_tiny, lm_tiny
from spmd import rules
from spmd.compiler_log import capture_compiler_log
from spmd.hlo import parse_groups
from spmd.mesh import create_mesh
from spmd.topology import libtpu_available, topology_devices
from trainers.models import attention
from trainers.run.train import build_mesh
from trainers.step.loss import abstract_batch, batch_shardings
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import make_task

MESHES = [
  "data=8,fsdp=1,tensor=1",
  "data=2,fsdp=4,tensor=1",
  "data=2,fsdp=2,tensor=2",
  "data=1,fsdp=2,tensor=4",
]
# Where XLA fell back before the embedding lookups were laid out by the rules.
FALLBACK_MESHES = ["data=2,fsdp=4,tensor=1", "data=2,fsdp=2,tensor=2"]
needs_libtpu = pytest.mark.skipif(
  not libtpu_available(), reason="needs libtpu: pip install -e '.[tpu]' (CI installs it)"
)


def _config(model: str, ici: str, rules_name: str):
  config = (llama_tiny if model == "llama" else lm_tiny).get_config()
  config.data.tokenizer, config.data.pack = "bytes", True
  config.model.vocab_size, config.model.seq_len = 256, 16
  config.model.num_layers, config.model.d_model, config.model.d_ff = 2, 64, 128
  config.model.num_heads = 8 if model == "llama" else 4
  if model == "llama":
    config.model.num_kv_heads = 4
  # Both layer layouts: the Llama scanned (as llama3_8b), the transformer unrolled (as lm_tiny).
  config.model.scan_layers = model == "llama"
  config.global_batch = 8
  config.mesh.ici, config.mesh.rules = ici, rules_name
  return config


def _fallbacks_of_train_step(config, devices, keep: dict | None = None) -> list:
  """The fallbacks XLA logged compiling the trainer's step; `keep` gets its mesh and HLO."""
  mesh, axes = build_mesh(config, devices)
  task = make_task(config)
  setup = make_state(task.model, config, mesh, axes, task.optimizer)
  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  batch = abstract_batch(task, config.global_batch, batch_shardings(task, setup.rules, mesh, axes))
  step = make_train_step(setup, task, config, mesh, axes)
  with capture_compiler_log(echo=False) as log:
    compiled = step.lower(state, batch).compile()
  if keep is not None:
    keep.update(mesh=mesh, hlo=compiled.as_text())
  return [f.describe() for f in log.fallbacks]


def _sequence_gathers(hlo: str, length: int) -> list[list[list[int]]]:
  """The replica groups of each all-gather whose result holds a whole `length` sequence."""
  found = []
  for line in hlo.splitlines():
    m = re.search(r"= (\S+) all-gather(?:-start)?\(", line)
    if m and re.search(rf"[\[,]{length}[,\]]", m.group(1)):
      found.append(sorted(parse_groups(line) or []))
  return found


def _groups_along(mesh, axis: str) -> list[list[int]]:
  """The partition ids (places in the mesh's flat device order) that differ only along `axis`."""
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  moved = np.moveaxis(ids, mesh.axis_names.index(axis), -1)
  return sorted(sorted(g) for g in moved.reshape(-1, moved.shape[-1]).tolist())


def _forced_fallbacks(devices) -> list:
  """A program with a reshard XLA can only make by copying: what the check must see."""
  mesh = create_mesh("data=2,fsdp=2,tensor=2", devices=devices)
  table = jax.ShapeDtypeStruct(
    (256, 64), jnp.float32, sharding=NamedSharding(mesh, P("tensor", "fsdp"))
  )
  ids = jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))

  def loss(table, ids):
    # XLA's own gather from an FSDP-split table, into batch-split rows.
    with rules.activation_rules(rules.FSDP_TP, mesh):
      rows = rules.constrain(jnp.take(table, ids, axis=0), ("batch", "length", "embed"))
    return jnp.sum(rows**2)

  with capture_compiler_log(echo=False) as log:
    jax.jit(jax.grad(loss)).lower(table, ids).compile()
  return log.fallbacks


def _layout(ici: str, rules_name: str) -> tuple:
  """How a preset splits a mesh's devices: the shard each device holds along each logical axis.

  Named apart from the mesh's axis names, which XLA never sees: `dp` on
  data=8 and on data=2,fsdp=4 both split the batch 8 ways in device order
  and replicate the rest, and compile to the same HLO. Presets and meshes
  that split the same way compile the same step.
  """
  sizes = {axis: int(size) for axis, size in (kv.split("=") for kv in ici.split(","))}
  shape_only = types.SimpleNamespace(shape=sizes)  # all `logical_to_spec` reads of a mesh
  # Each device's place along each mesh axis, devices in the mesh's flat order.
  places = dict(zip(sizes, np.indices(tuple(sizes.values())).reshape(len(sizes), -1)))
  preset = rules.preset(rules_name)
  layout = []
  for name in rules.LOGICAL_AXES:
    spec = rules.logical_to_spec((name,), preset, shape_only)
    entry = spec[0] if spec else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    shard = np.ravel_multi_index([places[a] for a in axes], [sizes[a] for a in axes]) if axes else 0
    layout.append(tuple(np.broadcast_to(shard, places[next(iter(sizes))].shape).tolist()))
  return tuple(layout)


def _cases(meshes=MESHES):
  """(model, mesh, preset) for every preset on every mesh, once per distinct layout."""
  for model in ("llama", "transformer"):
    layouts = set()
    for ici in meshes:
      for rules_name in sorted(rules.PRESETS):
        layout = _layout(ici, rules_name)
        if layout in layouts:
          continue  # e.g. fsdp_tp on a mesh without tensor is fsdp, dp on data=2,fsdp=4 is data=8's
        layouts.add(layout)
        marks = (pytest.mark.slow,)  # each compiles a train step: seconds apiece
        yield pytest.param(model, ici, rules_name, marks=marks, id=f"{model}-{ici}-{rules_name}")


def test_the_cpu_check_sees_a_forced_fallback():
  [*found] = _forced_fallbacks(jax.devices()[:8])
  assert any(f.operation == "gather" for f in found), found


@pytest.mark.parametrize("model,ici,rules_name", list(_cases()))
def test_train_step_compiles_without_a_fallback_on_cpu(model, ici, rules_name):
  assert _fallbacks_of_train_step(_config(model, ici, rules_name), jax.devices()[:8]) == []


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "transformer"])
@pytest.mark.parametrize("target", ["cpu", pytest.param("v5p-16", marks=needs_libtpu)])
def test_a_train_step_with_the_sequence_split_over_context_compiles_without_a_fallback(
  model, target
):
  """Context parallelism beside data and tensor: attention gathers keys and values, nothing whole.

  For the TPU the sequence is long enough for splash (256 tokens per shard).
  """
  config = _config(model, "data=2,context=2,tensor=2", "fsdp_tp")
  if target != "cpu":
    config.model.seq_len = 512
  devices = jax.devices()[:8] if target == "cpu" else topology_devices(target)
  compiled: dict = {}
  with attention.recorded_choices() as choices:
    assert _fallbacks_of_train_step(config, devices, compiled) == []
  assert {c.kernel for c in choices} == {"xla" if target == "cpu" else "splash"}, choices
  # The collectives the design expects: keys and values (arrays holding the
  # whole sequence) gathered along `context`, over its groups only.
  gathers = _sequence_gathers(compiled["hlo"], config.model.seq_len)
  context_groups = _groups_along(compiled["mesh"], "context")
  assert gathers and all(g == context_groups for g in gathers), (gathers, context_groups)


@needs_libtpu
def test_the_tpu_check_sees_a_forced_fallback_in_libtpus_log_folder():
  found = _forced_fallbacks(topology_devices("v5p-16"))
  assert any(f.operation == "gather" for f in found), found


@needs_libtpu
@pytest.mark.parametrize("model,ici,rules_name", list(_cases(FALLBACK_MESHES)))
def test_train_step_compiles_without_a_fallback_on_tpu(model, ici, rules_name):
  # v5p-16: 8 chips, one device each, 2 hosts. The meshes where the CPU
  # compiles fell back: CI's time goes to the layouts that can.
  config = _config(model, ici, rules_name)
  assert _fallbacks_of_train_step(config, topology_devices("v5p-16")) == []


@pytest.mark.slow  # compiles a train step: seconds
@pytest.mark.parametrize("target", ["cpu", pytest.param("v5p-16", marks=needs_libtpu)])
def test_a_routed_llama_split_over_the_expert_axis_gathers_tokens_not_experts(target):
  """data=2 x expert=2 x tensor=2: no fallback; no expert weight gathered whole (all 4
  experts on one device) by any collective; the tokens dispatched by all-gathers over
  the expert groups alone (and summed back by reduce-scatters over them), no all-to-all."""
  config = _config("llama", "data=2,expert=2,tensor=2", "fsdp_tp")
  config.model.update(moe_experts=4, moe_top_k=2, moe_d_ff=24)
  devices = jax.devices()[:8] if target == "cpu" else topology_devices(target)
  compiled: dict = {}
  assert _fallbacks_of_train_step(config, devices, compiled) == []
  hlo, mesh = compiled["hlo"], compiled["mesh"]
  # An expert weight [layers, 4, 64, 24] (or its d_ff halves over tensor) whole along experts.
  whole = re.compile(r"[\[,]4,(64,(24|12)|(24|12),64)[\],]")
  shapes = [m.group(1) for m in re.finditer(r"= (\S+) (?:all-gather|all-reduce)(?:-start)?\(", hlo)]
  assert not [s for s in shapes if whole.search(s)], shapes
  # The routed layer's own collectives (inside its shard_map), forward and backward.
  moved = {}
  for line in hlo.splitlines():
    m = re.search(r"= (\S+) (all-gather|reduce-scatter|all-to-all)(?:-start)?\(.*shard_map/", line)
    if m:
      moved.setdefault(m.group(2), set()).add(m.group(1).split("{")[0])
      assert sorted(parse_groups(line)) == _groups_along(mesh, "expert"), line
  # Tokens: 8 rows x 16 over data x expert, 32 a device, 64 gathered over expert, d_model 64.
  assert "f32[64,64]" in moved["all-gather"] and "f32[32,64]" in moved["reduce-scatter"], moved
  assert "all-to-all" not in moved, moved
