"""Every config in configs/ loads and builds its sharded state abstractly on 8 devices."""

import importlib

import jax
import pytest

from spmd.mesh import create_mesh
from trainers.models import llama
from trainers.models import transformer as lm
from trainers.step.state import make_state
from trainers.tasks import make_task
from trainers.tasks.llama import llama_config
from trainers.tasks.lm import transformer_config


@pytest.mark.parametrize(
  "name", ["default", "lm_tiny", "lm_tiny_bytes", "lm_small", "mlp", "llama_tiny", "llama3_8b"]
)
def test_config_builds_its_state_shapes_and_shardings(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  module_doc = importlib.import_module(f"configs.{name}").__doc__
  assert "spmd-train --config=configs/" in module_doc or "spmd-mesh" in module_doc
  mesh = create_mesh("data=-1,fsdp=2,tensor=2")
  config.mesh.rules = "fsdp_tp"
  setup = make_state(make_task(config).model, config, mesh)
  leaves = jax.tree.leaves(setup.abstract["params"])
  count = sum(leaf.size for leaf in leaves)
  if config.task == "lm":
    assert count == lm.param_count(transformer_config(config))
  elif config.task == "llama":
    assert count == llama.param_count(llama_config(config))
  else:  # 6 x parameters x batch: the FLOP count says how many parameters there are
    assert make_task(config).flops_per_step == 6.0 * count * config.global_batch
  kernel_specs = {s.spec for s in jax.tree.leaves(setup.shardings["params"])}
  assert any("fsdp" in str(spec) for spec in kernel_specs)
  if config.task in ("lm", "llama"):
    assert any("tensor" in str(spec) for spec in kernel_specs)
