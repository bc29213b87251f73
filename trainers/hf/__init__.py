"""Hugging Face model folders in and out: config.json and safetensors weights for our Llama.

  safetensors_files.py  a `.safetensors` file's tensors read by byte range
                        (local or gs://), and written by the format's encoder
  model_config.py       config.json <-> `LlamaConfig` fields; what the model
                        does not implement is an error naming the field
  agreement.py          whether a run's model agrees with the folder it starts
                        from; RoPE and a longer context may differ on request
  layouts.py            each parameter's HF tensor name and axis layout; a
                        routed MLP's experts one tensor each, named by family
  checkpoint.py         `read_params`: a folder's weights as sharded global
                        arrays, each host reading its devices' slices only
                        (of the layers and experts it holds)

It imports nothing else of `trainers`: the tasks, the restore and the
export (`trainers.checkpoints.hf_export`, `spmd-export --format=safetensors`)
build on it. A run starts from a folder with `checkpoint.init_from=FOLDER`, or with
`configs/hf.py:FOLDER`, which also takes the model's shape and tokenizer
from the folder.
"""
