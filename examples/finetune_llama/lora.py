"""LoRA on prompt/completion rows: a Hugging Face folder frozen, adapters trained, out two ways.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=examples/finetune_llama/lora.py:HF_FOLDER --workdir=workdir/lora
  spmd-export --format=peft --workdir=workdir/lora --out=workdir/lora/peft
  spmd-export --format=safetensors --merge-lora --workdir=workdir/lora --out=workdir/lora/merged
  spmd-sample --workdir=workdir/lora --prompt="Q: 2 + 3 = ? A: "

`config.py`'s run (its data, `sft.jsonl`, the loss on the completions, the
bf16 policy, the sample at the end) with the base weights frozen: rank-16
adapters on the seven projections of every layer (q, k, v, o, gate, up,
down) train alone, at LoRA's usual learning rate. `--format=peft` writes
them as `peft` does (`adapter_config.json`, `adapter_model.safetensors`),
`--merge-lora` the merged model, an HF folder `transformers` loads alone.
Found from this file, like the data, so a copy of the folder runs anywhere.
"""

import importlib.util
import pathlib

import ml_collections

HERE = pathlib.Path(__file__).resolve().parent


def _full_fine_tune():
  """`config.py` beside this file (a copy of the folder is no package)."""
  spec = importlib.util.spec_from_file_location("finetune_llama_config", HERE / "config.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(folder: str = "") -> ml_collections.ConfigDict:
  config = _full_fine_tune().get_config(folder)
  config.lora.targets = "q,k,v,o,gate,up,down"
  config.lora.rank = 16
  config.lora.alpha = 32.0  # the adapters' scale is alpha / rank
  config.train.learning_rate = 2e-4
  return config
