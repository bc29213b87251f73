"""A trainer config small enough for tests: seconds per run on 2 CPU cores.

  spmd-train --config=tests/configs/train_tiny.py --workdir=/tmp/run \\
      --config.data.dir=DATA --config.data.source='SRC/*.txt'
"""

from configs import default
from tests import injection


def get_config():
  config = default.get_config()
  config.model.seq_len = 16
  config.model.num_layers = 1
  config.model.d_model = 32
  config.model.num_heads = 2
  config.model.d_ff = 64
  config.global_batch = 8
  config.data.validation_percent = 25.0
  config.train.steps = 20
  config.train.learning_rate = 1e-2
  config.train.warmup_steps = 2
  config.log_every = 1
  config.eval_every = 10
  config.eval_batches = 2
  config.checkpoint.every = 5
  # No sample at the end (its decode costs every run CPU): tests/test_train.py's
  # reference run asks for one and checks it.
  config.sample_tokens = 0
  # No loss.png either (matplotlib costs process 0 about a CPU second a run):
  # the runs that check it (test_train's reference, the fault tests of the
  # run's end) ask for it.
  config.loss_curve = False
  config.transfer_guard = "disallow"  # any implicit transfer in the loop is an error
  # Fault injection (tests/injection.py), off, so tests can set it by
  # override (--config.hook_settings.faults.inject_stall=...); the param hash
  # in the summary.
  return injection.add_to(config, report_param_hash=True)
