"""Train your own language model: an NNX decoder with z-loss, lion and a hook.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=examples/custom_lm/config.py --workdir=workdir/custom_lm

Copy this folder anywhere and edit it there: `config.task` names `task.py`
relative to this file, so the copy runs with no PYTHONPATH and no change to
the harness. `config.model` is the task's own section (`task.ModelConfig`);
everything else is the harness's (`configs/default.py`), where an unknown key
is an error.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.task = "task.py:make_task"
  config.model = ml_collections.ConfigDict(
    {
      "seq_len": 128,
      "num_layers": 2,
      "d_model": 128,
      "num_heads": 4,
      "d_ff": 384,
      "vocab_size": 256,
      "rotary": True,
      "tie_embeddings": True,
      "z_loss_weight": 1e-4,
      "norm_every": 50,
    }
  )
  config.global_batch = 32
  config.train.steps = 300
  # Read by the task's lion (task.lion_optimizer), not by the named optimizers:
  # lion's sign updates want a smaller step and more decay than adamw's.
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 30
  config.train.weight_decay = 0.3
  config.train.b2 = 0.99
  config.log_every = 20
  config.eval_every = 100
  config.eval_batches = 4
  config.checkpoint.every = 100
  config.sample_tokens = 0  # the sample is the built-in LM task's report, not this task's
  return config
