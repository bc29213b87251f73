"""Train your own model: a CNN with BatchNorm and Dropout on generated shapes.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=examples/cnn_classifier/config.py --workdir=workdir/cnn

Copy this folder anywhere and edit it there: `config.task` names `task.py`
relative to this file, so the copy runs with no PYTHONPATH and no change to
the harness. Keys set here that the defaults (`configs/default.py`) do not
have are errors; `config.model` is the task's own section (`task.ModelConfig`).
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.task = "task.py:make_task"
  config.model = ml_collections.ConfigDict(
    {"num_classes": 6, "features": (16, 32, 64), "dropout_rate": 0.1}
  )
  config.data.name = "shapes"
  config.data.eval_split = "test"
  config.global_batch = 64
  config.train.steps = 300
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 20
  config.train.weight_decay = 0.0
  config.log_every = 20
  config.eval_every = 100
  config.eval_batches = 0  # the whole test split
  config.checkpoint.every = 100
  config.sample_tokens = 0
  return config
