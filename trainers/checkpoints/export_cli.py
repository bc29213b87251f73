"""`spmd-export`: a run's trained weights as one plain-array file, or a Hugging Face folder.

  spmd-export --workdir=W [--step=N] [--checkpoint=DIR] [--out=FILE]

writes `W/export/params_step_<N>.npz` (or `--out`) with `trainers.checkpoints.export.export`;
that module describes the file and loads it back (`load_params`, `load_model`).

  spmd-export --format=safetensors --workdir=W [--out=DIR] [--dtype=D] [--max-shard-size=5GB]

writes a Llama run's checkpoint as a folder `transformers` loads
(`trainers.checkpoints.hf_export`: config.json, model.safetensors or shards with their
index, the tokenizer files), in the dtype of the files it was imported from
unless `--dtype` says otherwise. A LoRA run's checkpoint holds adapters, not a model:

  spmd-export --format=peft --workdir=W [--out=DIR]

writes them as a `peft` adapter folder (adapter_config.json, adapter_model.safetensors;
`trainers.checkpoints.peft`), and `--format=safetensors --merge-lora` the model with
them merged into the base weights the run started from (`trainers.checkpoints.lora_export`).
"""

from __future__ import annotations

import sys

import numpy as np

from spmd import errors, startup_gc
from trainers.checkpoints import export, hf_export, lora_export


def main(argv: list[str] | None = None) -> int:
  """`spmd-export`: see the module docstring. 0, or 2 on a user error (`spmd.errors`)."""
  startup_gc.pause_collection()  # until `_main` has read its arguments
  return errors.run("spmd-export", lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> None:
  parser = errors.ArgumentParser(prog="spmd-export", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="the run's workdir")
  parser.add_argument("--step", type=int, default=None, help="default: the latest committed")
  parser.add_argument("--checkpoint", default="", help="a workdir, checkpoint or step directory")
  parser.add_argument(
    "--out", default=None, help="default: <workdir>/export/params_step_N.npz (hf_step_N/)"
  )
  parser.add_argument("--format", choices=("npz", "safetensors", "peft"), default="npz")
  parser.add_argument(
    "--merge-lora",
    action="store_true",
    help="safetensors, a LoRA run: the base weights with the adapters merged in",
  )
  parser.add_argument(
    "--dtype",
    default=None,
    choices=hf_export.EXPORT_DTYPES,
    help="safetensors: the files' dtype (default: the imported files')",
  )
  parser.add_argument(
    "--max-shard-size", default="5GB", help="safetensors: the largest file before sharding"
  )
  args = parser.parse_args(argv)
  startup_gc.freeze_and_resume()  # this module imported the exporters
  if args.merge_lora and args.format != "safetensors":
    parser.error(f"--merge-lora writes --format=safetensors, not --format={args.format}")
  if args.format == "peft":
    with errors.user_input(ValueError, FileNotFoundError):
      adapters = lora_export.export_peft(
        args.workdir, args.out, step=args.step, checkpoint=args.checkpoint
      )
    print(
      f"spmd-export: step {adapters.step}, {adapters.parameters:,} adapter parameters -> "
      f"{adapters.folder} ({', '.join(adapters.files)})",
      flush=True,
    )
    return
  if args.format == "safetensors":
    with errors.user_input(ValueError, FileNotFoundError):
      done = hf_export.export(
        args.workdir,
        args.out,
        step=args.step,
        checkpoint=args.checkpoint,
        dtype=args.dtype,
        max_shard_bytes=hf_export.parse_size(args.max_shard_size),
        weights_of=lora_export.merged_weights if args.merge_lora else None,
      )
    print(
      f"spmd-export: step {done.step}, {done.parameters:,} parameters in {done.dtype} -> "
      f"{done.folder} ({', '.join(done.files)})",
      flush=True,
    )
    return
  with errors.user_input(ValueError, FileNotFoundError):  # the workdir, checkpoint or step given
    path = export.export(args.workdir, args.out, step=args.step, checkpoint=args.checkpoint)
  exported = export.load_export(str(path))
  count = sum(np.size(x) for x in export.flatten(exported.params).values())
  print(f"spmd-export: step {exported.step}, {count:,} parameters -> {path}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
