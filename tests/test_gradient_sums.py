"""Under the bfloat16 policy, weight gradients are summed across devices in float32.

The built-in models on `data=2,fsdp=4` with the fsdp rules: each weight's
gradient is a sum over the batch's tokens, split over all 8 devices, so
every one of them is reduced across devices (an all-reduce over `data`, a
reduce-scatter or all-reduce over `fsdp`). Computed by a bf16 x bf16 dot
with a bf16 result, those sums would be bf16, rounding at each step.

Two views of the same step. The lowered program (any machine): every
weight-gradient dot, the one that contracts the tokens, returns float32,
and every reduction the program writes itself (the embedding's) is
float32. XLA:CPU widens every bf16 operation to f32 when it compiles, so
only a TPU compiler shows what crosses the devices: the step compiled
ahead of time for a v5e-8 slice through libtpu (no chip needed) holds no
bf16 all-reduce or reduce-scatter of a parameter's gradient.
"""

from __future__ import annotations

import importlib
import re

import jax
import pytest

from spmd.layout import batch_sharding
from spmd.topology import libtpu_available, topology_devices
from trainers.step.loss import abstract_batch
from trainers.step.mesh import build_mesh
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import losses, make_task

needs_libtpu = pytest.mark.skipif(
  not libtpu_available(), reason="needs libtpu: pip install -e '.[tpu]' (CI installs it)"
)
# The built-in models: Llama, the generic transformer, the MLP classifier.
CONFIGS = ["llama_tiny", "lm_tiny_bytes", "mlp"]


def lowered_step(name: str, devices=None):
  """`configs.<name>`'s bf16 train step on data=2,fsdp=4, lowered, and its state's setup."""
  config = importlib.import_module(f"configs.{name}").get_config()
  config.mesh.ici, config.mesh.rules = "data=2,fsdp=4", "fsdp"
  config.train.precision = "bfloat16"
  config.global_batch = 16
  task = make_task(config)
  mesh, axes = build_mesh(config, devices)
  setup = make_state(task.model, config, mesh, axes)
  step = make_train_step(setup, task, config, mesh, axes)
  batch = abstract_batch(task, config.global_batch, batch_sharding(mesh, axes))
  return step.lower(setup.abstract, batch), setup


def weight_gradient_dots(text: str) -> list[str]:
  """The result dtypes of the dots that contract the tokens: [tokens, in]^T @ [tokens, out]."""
  pattern = (
    r"= (\w+)\[[^\]]*\]\S* dot\([^)]*\), lhs_contracting_dims=\{0\}, rhs_contracting_dims=\{0\}"
  )
  return re.findall(pattern, text)


def reductions(text: str) -> list[tuple[str, str]]:
  """(dtype, shape) of every operand of the all-reduces and reduce-scatters in `text`."""
  found = []
  for m in re.finditer(r"= (.*?) (?:reduce-scatter|all-reduce)(?:-start)?\(", text):
    found += re.findall(r"\b(\w+)\[([\d,]*)\]", m.group(1))
  return found


@pytest.mark.parametrize("name", CONFIGS)
def test_the_lowered_step_computes_weight_gradients_and_writes_its_sums_in_float32(name):
  lowered, _ = lowered_step(name)
  text = lowered.as_text(dialect="hlo")
  dots = weight_gradient_dots(text)
  # Every dense weight's gradient (seven per Llama layer, the projection's) and none in bf16.
  assert len(dots) >= 2 and set(dots) == {"f32"}, dots
  # The embedding's own reductions (its shard_map's transpose) are float32.
  assert {dtype for dtype, _ in reductions(text)} <= {"f32", "s32"}, reductions(text)


def _parameter_shapes(setup) -> set[str]:
  """Each parameter's shape and its shard's shape on the mesh, as HLO writes them."""
  shapes = set()
  params, shardings = setup.abstract["params"], setup.shardings["params"]
  for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
    for shape in (leaf.shape, sharding.shard_shape(leaf.shape)):
      shapes.add(",".join(map(str, shape)))
      # dense contracts flattened dims: [d, heads, kv] is also [d, heads * kv].
      if len(shape) == 3:
        shapes.add(f"{shape[0]},{shape[1] * shape[2]}")
        shapes.add(f"{shape[0] * shape[1]},{shape[2]}")
  return shapes


@needs_libtpu
@pytest.mark.parametrize("name", CONFIGS)
def test_a_tpu_compile_sums_every_weight_gradient_across_devices_in_float32(name):
  """XLA:TPU as it compiles for a v5e-8 slice: no parameter's gradient crosses devices in bf16.

  A weight cast to bf16 before its product left the gradient's sums in
  bf16 (every dense weight and norm scale), and a float32 sum rounded to
  bf16 after it (the embedding table's) was rounded ahead of the sum by
  XLA:TPU. The MLP's step may still all-reduce a bf16 activation (XLA
  contracts its fsdp-split input dimension in place rather than gather the
  kernel): an activation, in the compute dtype as the policy means.
  """
  lowered, setup = lowered_step(name, topology_devices("v5e-8"))
  found = reductions(lowered.compile().as_text())
  assert found, "no reductions: the mesh split nothing"
  parameters = _parameter_shapes(setup)
  narrow = [(d, s) for d, s in found if d == "bf16" and s in parameters]
  if name != "mlp":
    narrow = [(d, s) for d, s in found if d == "bf16"]  # no bf16 sum of any kind
  assert not narrow, narrow


@needs_libtpu
def test_a_tpu_compile_sums_the_chunked_losss_projection_gradient_in_float32(monkeypatch):
  """The loss in chunks (its own VJP) returns the output projection's gradient in float32."""
  monkeypatch.setattr(losses, "CHUNK_LOGITS", 2**14)
  # llama_tiny's 64 tokens at a 1024 vocabulary, 2 rows per device: chunks of 8.
  assert losses.default_chunk(64, 1024, rows=2) == 8
  lowered, _ = lowered_step("llama_tiny", topology_devices("v5e-8"))
  found = reductions(lowered.compile().as_text())
  assert found and not [(d, s) for d, s in found if d == "bf16"], found
