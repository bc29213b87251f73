"""lm_tiny on subword tokens: a BPE of 1024 ids trained on the corpus, documents packed.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=configs/lm_tiny_bpe.py --workdir=workdir/lm_tiny_bpe

The first run trains the tokenizer on the text corpus's train files and packs
the corpus into windows (cached in the data dir); later runs reuse both.
"""

from configs import lm_tiny


def get_config():
  config = lm_tiny.get_config()
  config.data.tokenizer = "bpe"
  config.data.pack = True
  config.model.vocab_size = 1024
  return config
