"""The demo (`make demo`): a tiny LM on subword tokens that learns in minutes on 2 CPU cores.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=configs/lm_tiny.py --workdir=workdir/lm_tiny

(`make demo` runs exactly this.) On one process: drop the spmd-launch part.

The first run trains a BPE tokenizer of `model.vocab_size` ids on the
embedded corpus's train files and packs the corpus's documents into windows
with segment ids (both cached in the data dir); later runs reuse them.
`configs/lm_tiny_bytes.py` is the same model on bytes.
"""

from configs import lm_tiny_bytes


def get_config():
  config = lm_tiny_bytes.get_config()
  config.data.tokenizer = "bpe"
  config.data.pack = True
  config.model.vocab_size = 1024
  # A byte-level BPE joins a space to the word after it, so a prompt that ends
  # in a space ends in a token that training text rarely holds.
  config.sample_prompt = "import"
  return config
