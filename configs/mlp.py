"""An MLP classifier on the generated `blobs` dataset: the non-LM path, in seconds.

  spmd-train --config=configs/mlp.py --workdir=workdir/mlp
  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=configs/mlp.py --workdir=workdir/mlp
"""

from configs import default
from trainers.tasks import classifier


def get_config():
  config = default.get_config()
  config.task = "classifier"
  config.model = classifier.default_model_config()  # the task's own section
  config.data.name = "blobs"
  config.data.eval_split = "test"
  config.global_batch = 128
  config.train.steps = 300
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 20
  config.log_every = 20
  config.eval_every = 100
  config.eval_batches = 0  # the whole test split
  config.checkpoint.every = 100
  config.sample_tokens = 0
  return config
