"""`spmd-train` whose process 0 takes SPMD_TEST_PAUSE_S seconds longer to train its BPE.

Usage: slow_tokenizer_train.py [spmd-train flags, with data.tokenizer=bpe]

Stands for a preparation step that outlasts `data.prepare_timeout_s` (a
large corpus's BPE) at a moment a test can count on
(tests/test_sources_train.py): the other processes wait for the tokenizer
at the preparation's barrier. The tokenizer itself is the real one.
"""

import os
import time

from spmd import env_names
from trainers.data.prepare import tokenizer
from trainers.run import train_cli

bpe_tokenizer = tokenizer.bpe_tokenizer


def pause_on_process_0(*args, **kwargs):
  if os.environ.get(env_names.ENV_PROCESS_ID) == "0":  # set by spmd-launch; JAX is not yet up
    time.sleep(float(os.environ["SPMD_TEST_PAUSE_S"]))
  return bpe_tokenizer(*args, **kwargs)


tokenizer.bpe_tokenizer = pause_on_process_0

if __name__ == "__main__":
  raise SystemExit(train_cli.main())
