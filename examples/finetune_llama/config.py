"""Fine-tune open weights on prompt/completion rows: a Hugging Face folder in, one out.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=examples/finetune_llama/config.py:HF_FOLDER --workdir=workdir/ft
  spmd-export --format=safetensors --workdir=workdir/ft --out=workdir/ft/hf

HF_FOLDER (local or gs://) is a Llama, Mistral or Qwen2 folder
(`configs/hf.py` reads its shape, weights and tokenizer). The data is
`sft.jsonl` beside this file, found from the file itself, so a copy of this
folder runs from anywhere: each line `{"prompt": ..., "completion": ...}`,
the loss on the completion and its EOS only (docs/finetune.md). The run
ends with a greedy sample of `sample_prompt` through the KV cache.
"""

import pathlib

import ml_collections

from configs import hf

HERE = pathlib.Path(__file__).resolve().parent


def get_config(folder: str = "") -> ml_collections.ConfigDict:
  config = hf.get_config(folder)
  config.data.sources = str(HERE / "sft.jsonl")
  config.data.format = "prompt_completion"
  config.data.validation_percent = 10
  config.model.seq_len = min(config.model.seq_len, 256)  # the rows are short
  config.global_batch = 16
  config.train.steps = 100
  config.train.learning_rate = 1e-4
  config.sample_prompt = "Q: 2 + 3 = ? A: "
  config.sample_tokens = 8
  return config
