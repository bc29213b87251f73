"""Checkpoints and what reads them back.

A checkpoint is one orbax step directory holding two items: `state` (the
sharded train state, written by every host for its own shards) and `data`
(the input pipeline's position, JSON). Nothing is pickled or unpickled.

  manager.py       orbax's CheckpointManager, set up: judged step folders, barriers, handlers
  saver.py         asynchronous saves: the training thread only starts a host copy
  restore.py       resume, warm start or fresh, in that order
  lora_base.py     the base weights a LoRA checkpoint's adapters were trained on: source and content hash
  reading.py       a checkpoint's saved tree, the same-model check, the weights alone
  damage.py        a checkpoint that cannot be restored, told apart from storage trouble
  step_folders.py  which step folders are checkpoints, the harness's unfinished saves, or another tool's
  saved_run.py     a run's resolved config and its checkpoints' weights, read back
  saved_arrays.py  a step's weights read by index ranges, a block at a time (the HF export's reader)
  export.py        the trained weights as one plain-array file; `export_cli.py` is `spmd-export`
  hf_export.py     a Llama run's weights as a Hugging Face folder (`spmd-export --format=safetensors`)
  peft.py          LoRA adapters in peft's folder format: names, layout, adapter_config.json, read back
  lora_export.py   a LoRA run's adapters as a peft folder (`--format=peft`), or merged (`--merge-lora`)
"""
