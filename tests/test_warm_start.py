"""Warm starts (`checkpoint.init_from`) read the weights only, with real `spmd-train` jobs.

One source run: adamw for 10 steps on 2 processes x 2 devices, of a model
with BatchNorm statistics and a variable of its own
(tests/configs/stateful_classifier.py). Then two warm starts from it, each
one step long with the warmup's first learning rate, 0, so the parameters
after that step are the ones the run started from, bit for bit; and
`model.bn_momentum=1.0` keeps the running statistics as restored:
  * with sgd (another optimizer: other moments, other shapes), on 1 process
    x 4 devices, from the source's workdir;
  * with adamw, on 1 process x 2 devices, from a copy of the source's
    checkpoints whose optimizer-state entries are damaged: they are never read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from spmd.mesh import create_mesh
from tests.configs import stateful_classifier
from tests.faults import harness
from tests.multiprocess import ROOT
from tests.session_settings import compilation_cache_dir
from trainers.checkpoints.damage import CheckpointError
from trainers.checkpoints.manager import make_manager
from trainers.checkpoints.restore import restore_or_init
from trainers.step.state import make_state

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

CONFIG = ROOT / "tests" / "configs" / "stateful_classifier.py"
SOURCE_STEPS = 10
# The warm runs: one step, saved; its learning rate is the warmup's first, 0.
WARM = (
  "--config.train.steps=1",
  "--config.checkpoint.every=1",
  "--config.model.bn_momentum=1.0",
)


def start(env: dict, workdir: Path, processes: int, devices: int, *overrides: str):
  train = [
    "trainers.run.train_cli",
    f"--config={CONFIG}",
    f"--workdir={workdir}",
    f"--config.data.dir={env['data']}",
    *overrides,
  ]
  environment = dict(os.environ, PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=env["cache"])
  return harness.launch(train, workdir, processes, devices, 0, 400, environment, ROOT)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  env = {
    "data": str(tmp_path_factory.mktemp("blobs")),
    "cache": compilation_cache_dir(),
  }
  workdir = tmp_path_factory.mktemp("source") / "run"
  job = start(
    env,
    workdir,
    2,
    2,
    "--config.train.optimizer=adamw",
    f"--config.train.steps={SOURCE_STEPS}",
    f"--config.checkpoint.every={SOURCE_STEPS}",
  )
  assert job.wait(480) == 0, job.output
  return dict(env, workdir=workdir, state=harness.saved_state(workdir, SOURCE_STEPS))


def _flat(tree) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x) for p, x in flat}


def assert_weights_carried(saved: dict, warm: dict) -> None:
  """The warm run's parameters and statistics are the source's, bit for bit; `calls` went on."""
  for part in ("params", "model_state"):
    want, got = _flat(saved[part]), _flat(warm[part])
    assert sorted(got) == sorted(want), (part, sorted(got), sorted(want))
    for key in want:
      if key == "calls":
        continue
      assert got[key].dtype == want[key].dtype, key
      assert got[key].tobytes() == want[key].tobytes(), f"{part}.{key} differs"
  # The model's own variable was carried and counted the warm run's one step.
  assert int(saved["model_state"]["calls"]) == SOURCE_STEPS
  assert int(warm["model_state"]["calls"]) == SOURCE_STEPS + 1


def reader(directory: Path) -> ocp.CheckpointManager:
  """orbax's own reader of a run's checkpoints, as a user would open them."""
  return ocp.CheckpointManager(
    directory,
    item_handlers={"state": ocp.PyTreeCheckpointHandler()},
    options=ocp.CheckpointManagerOptions(read_only=True),
  )


def summary(workdir: Path) -> dict:
  return json.loads((workdir / "summary.json").read_text())


def test_a_warm_start_with_another_optimizer_on_another_mesh_starts_from_the_weights(
  source, tmp_path
):
  workdir = tmp_path / "warm_sgd"
  job = start(
    source,
    workdir,
    1,
    4,
    *WARM,
    "--config.train.optimizer=sgd",
    f"--config.checkpoint.init_from={source['workdir'] / 'checkpoints'}",
  )
  assert job.wait(400) == 0, job.output
  given = source["workdir"] / "checkpoints"
  assert summary(workdir)["resumed_from"] == f"init_from {given} step {SOURCE_STEPS}"
  warm = harness.saved_state(workdir, 1)
  assert_weights_carried(source["state"], warm)
  # A fresh optimizer of the new kind (sgd's momentum, no adam moments), step and count.
  assert int(warm["step"]) == 1 and int(warm["updates"]) == 1
  parts = {part for key in _flat(warm["opt_state"]) for part in key.split(".")}
  assert "trace" in parts and not parts & {"mu", "nu"}, parts


def damage_optimizer_state(state_dir: Path) -> list[str]:
  """Overwrites every optimizer-state entry of a saved state with bytes that decode to nothing.

  orbax keeps all of a step's arrays in one OCDBT database: the parameters'
  and the moments' chunks share data files, and small ones live inside its
  b-tree nodes, so no file holds the optimizer state alone. Its entries are
  keys (`opt_state.<path>/.zarray`, `opt_state.<path>/<chunk>`); one
  transaction writes garbage under each, and the database's new version
  points at it. The parameters' keys are left as they were.
  """
  kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state_dir}/"}).result()
  keys = [k for k in kv.list().result() if k.startswith(b"opt_state.")]
  txn = ts.Transaction()
  for key in keys:
    kv.with_transaction(txn)[key] = b"\xde\xad\xbe\xef damaged"
  txn.commit_async().result()
  return [k.decode() for k in keys]


# orbax leaves a callback behind when its own read of the damaged state fails.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_warm_start_never_reads_the_optimizer_state(source, tmp_path):
  damaged = tmp_path / "damaged"
  shutil.copytree(source["workdir"] / "checkpoints", damaged / "checkpoints")
  keys = damage_optimizer_state(damaged / "checkpoints" / str(SOURCE_STEPS) / "state")
  assert any(k.endswith(".zarray") for k in keys) and len(keys) > 4, keys
  # The damage is real: orbax's own reading of the state fails on it.
  with reader(damaged / "checkpoints") as manager:
    with pytest.raises(ValueError, match=r"opt_state\..*/\.zarray"):
      manager.item_metadata(SOURCE_STEPS)
  workdir = tmp_path / "warm_adamw"
  job = start(
    source,
    workdir,
    1,
    2,
    *WARM,
    "--config.train.optimizer=adamw",  # the same optimizer: only the damage is in the way
    f"--config.checkpoint.init_from={damaged / 'checkpoints'}",
  )
  assert job.wait(400) == 0, job.output
  assert_weights_carried(source["state"], harness.saved_state(workdir, 1))


def test_a_warm_start_of_another_shape_names_each_array_with_both_shapes(source, tmp_path):
  config = stateful_classifier.get_config()
  config.model.hidden = 48  # the source's is 32
  setup = make_state(stateful_classifier.make_task(config).model, config, create_mesh("data=-1"))
  with make_manager(tmp_path / "own", every=1, keep=1) as own:
    with pytest.raises(CheckpointError) as raised:
      restore_or_init(
        own,
        setup.abstract,
        setup.shardings,
        setup.init,
        str(source["workdir"]),  # a run's workdir: its checkpoints/
        setup.init_with_weights,
      )
  message = str(raised.value)
  assert "params.hidden.kernel: saved (16, 32) float32, this config needs (16, 48) float32" in (
    message
  )
  assert "model_state.norm.mean: saved (32,) float32, this config needs (48,) float32" in message
  assert "opt_state" not in message and "the optimizer and schedule may differ" in message
