"""The trainer on the chip: an orbax checkpoint of the sharded state, and a bit-identical resume.

Both run in the test process (one program at a time can hold the chip), through
the functions `spmd-train` calls: `train_and_evaluate` starts with
`spmd.initialize()`, so on a one-host TPU VM these runs also show that no
metadata server is asked and no variable needs setting.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp

from configs import llama_tiny, llama_tpu_check
from spmd import errors
from trainers.checkpoints.manager import make_manager
from trainers.checkpoints.saver import Saver
from trainers.run.train import train_and_evaluate
from trainers.step.mesh import build_mesh
from trainers.step.state import make_state
from trainers.tasks import make_task


def _on_chip(tree) -> None:
  platforms = {d.platform for x in jax.tree.leaves(tree) for d in x.devices()}
  assert platforms == {"tpu"}, platforms


def test_an_orbax_save_and_restore_of_a_sharded_state_on_the_chip(tmp_path):
  """The trainer's own saver (a copy to pinned host memory, then orbax) and orbax's restore."""
  config = llama_tiny.get_config()
  task = make_task(config)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes, task.optimizer)
  state = setup.init()
  _on_chip(state)
  saver = Saver(make_manager(tmp_path / "checkpoints", every=1, keep=1))
  assert saver.save(3, state, {"position": 7})
  saver.close()

  manager = make_manager(tmp_path / "checkpoints", every=1, keep=1)
  wanted = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  args = ocp.args.Composite(state=ocp.args.StandardRestore(wanted), data=ocp.args.JsonRestore())
  restored = manager.restore(3, args=args)
  manager.close()
  assert restored.data == {"position": 7}
  _on_chip(restored.state)
  saved, back = jax.tree.leaves(state), jax.tree.leaves(restored.state)
  assert len(saved) == len(back) > 0
  for a, b in zip(saved, back, strict=True):
    assert a.sharding == b.sharding and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _train(workdir, data_dir, **train) -> dict[int, float]:
  """llama_tiny at sequence 256 for 20 steps (or up to `stop_at_step`); its losses by step."""
  config = llama_tiny.get_config()
  config.model.seq_len = 256
  config.global_batch = 8
  config.data.dir = str(data_dir)
  config.train.steps = 20
  config.train.warmup_steps = 5
  config.log_every = 1
  config.eval_every = 0
  config.sample_tokens = 0
  config.checkpoint.every = 10
  config.train.update(train)
  train_and_evaluate(config, str(workdir))
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_spmd_train_of_llama_tiny_resumes_bit_identically_on_the_chip(tmp_path):
  """Stopped at step 10 and resumed: steps 11-20 lose exactly what the straight run's do."""
  data = tmp_path / "data"  # prepared once (tokenizer, packed windows), shared by the runs
  straight = _train(tmp_path / "straight", data)
  assert sorted(straight) == list(range(1, 21))
  assert all(np.isfinite(list(straight.values())))
  assert np.mean([straight[s] for s in (18, 19, 20)]) < np.mean([straight[s] for s in (1, 2, 3)])
  first = _train(tmp_path / "resumed", data, stop_at_step=10)
  assert sorted(first) == list(range(1, 11))
  resumed = _train(tmp_path / "resumed", data)
  assert [resumed[s] for s in range(11, 21)] == [straight[s] for s in range(11, 21)]


def test_spmd_train_of_a_batch_the_chip_cannot_hold_is_one_line_and_exit_2(tmp_path, capsys):
  """The check Llama at 12 rows: libtpu refuses the step, and the run says so in one line.

  Through `spmd.errors.run`, as `spmd-train`'s main runs its body (in this
  process: one program at a time can hold the chip).
  """
  config = llama_tpu_check.get_config()
  config.global_batch = 12
  config.data.dir = str(tmp_path / "data")
  config.train.steps = 2
  config.eval_every = 0
  config.checkpoint.every = 0
  code = errors.run("spmd-train", lambda: train_and_evaluate(config, str(tmp_path / "run")))
  err = capsys.readouterr().err
  assert code == errors.EXIT_USER_ERROR, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  line = err.strip().splitlines()[-1]  # the run's own log lines come before it
  assert line.startswith("spmd-train: the step does not fit in device memory: "), err[-3000:]
  assert "12 rows per device need" in line and "GiB a device has" in line, line
  assert "--config.train.micro_batches=" in line, line
