"""C1: per-device memory of Llama-3-8B at 131,072 tokens on v5p-256 over a `context` axis ÷ MaxText's.

  python -m benchmarks.context_memory [--json=out.json] [--config=configs/llama3_8b.py]
      [--topology=v5p-256] [--ici=data=1,fsdp=16,context=8,tensor=1]
      [--seq-len=131072 --global-batch=32 --num-layers=N]

M1's method (`benchmarks.pod_memory`) at long context: both sides are the
same field of the compiled program's `memory_analysis()`, MaxText's "Total
memory size" (arguments + outputs - aliased + temporaries). Ours is that
field of the step `spmd-plan` compiles through libtpu for

  spmd-plan --config=configs/llama3_8b.py --topology=v5p-256 \\
      --config.model.seq_len=131072 --config.global_batch=32 \\
      --config.mesh.ici=data=1,fsdp=16,context=8,tensor=1 --config.mesh.rules=fsdp

32 rows of 131,072 tokens (4M tokens a step), the batch over 16 FSDP
devices and each row over 8 `context` devices in the load-balanced order,
the state over all 128 (`embed` on `fsdp`, then `context`), splash on each
device's queries against the gathered keys and values, its backward in two
kernels (`attention.SPLASH_FUSED_BACKWARD_MAX_KEY_BLOCKS`).

MaxText's side is a constant, `MAXTEXT_BYTES`: MaxText 0.2.5's own
ahead-of-time compile (`MAXTEXT_COMMAND`) at the same model, tokens a step,
mesh (its `ici_context_parallelism`, load-balanced), TPU flash attention
and full remat. It is not recomputed here: MaxText stays out of this
project's dependencies.

Goal: 1.0 (as much memory as MaxText needs).
"""

from __future__ import annotations

import argparse
import os

import jax

jax.config.update("jax_platforms", "cpu")

from benchmarks import common  # noqa: E402
from benchmarks.pod_memory import GIB, MAXTEXT_FIELD, Compiled, compiled_plan, describe  # noqa: E402

MAXTEXT_BYTES = 27_770_971_904
"""MaxText 0.2.5's "Total memory size" for Llama-3-8B, 131,072 tokens, 32 rows, fsdp=16 x context=8.

From its `Memory analysis` line: 758,747,136 B of arguments + 756,025,088 of
outputs - 756,019,200 aliased + 27,012,218,880 of temporaries (25.16 GiB),
25.86 GiB in all."""
MAXTEXT_COMMAND = (
  'pip install "maxtext[tpu]==0.2.5"  # in a Python 3.12 venv (jax 0.12.1, libtpu 0.0.52); then:\n'
  "python -m maxtext.trainers.pre_train.train_compile <its maxtext/configs/base.yml> "
  "compile_topology=v5p-256 compile_topology_num_slices=1 model_name=llama3-8b "
  "max_target_length=131072 per_device_batch_size=0.25 ici_fsdp_parallelism=16 "
  "ici_context_parallelism=8 remat_policy=full attention=flash "
  "context_parallel_load_balance=true run_name=aot base_output_directory=OUT"
)
"""How `MAXTEXT_BYTES` was measured (its `global_batch_size_to_train_on` is 32; its context
parallelism is all-gathered keys and values, as ours, its splash backward unfused)."""
CONTEXT_MESH = {"ici": "data=1,fsdp=16,context=8,tensor=1", "rules": "fsdp"}


def plan_for(args: argparse.Namespace) -> Compiled:
  """The plan of the config at the long setting on the topology, and MaxText's field of it."""
  config = common.load_config(args.config)
  config.mesh.ici, config.mesh.rules = args.ici, CONTEXT_MESH["rules"]
  config.model.seq_len = args.seq_len
  config.global_batch = args.global_batch
  if args.num_layers:
    config.model.num_layers = args.num_layers
  return compiled_plan(config, args.topology)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/llama3_8b.py")
  parser.add_argument("--topology", default="v5p-256")
  parser.add_argument("--ici", default=CONTEXT_MESH["ici"])
  parser.add_argument("--seq-len", type=int, default=131072)
  parser.add_argument("--global-batch", type=int, default=32)
  parser.add_argument("--num-layers", type=int, default=0, help="shrink the model (tests)")
  parser.add_argument("--json")
  args = parser.parse_args()
  ours = plan_for(args)
  name = (
    f"{os.path.basename(args.config)}, {args.seq_len:,} tokens x {args.global_batch} rows "
    f"on {args.topology}, {args.ici}"
  )
  maxtext = f"MaxText 0.2.5 {MAXTEXT_BYTES / GIB:.2f} GiB, both {MAXTEXT_FIELD}"
  row = common.row(
    "C1",
    f"bytes per device, {name} ÷ MaxText's (its own AOT compile, context parallelism)",
    ours.maxtext_field_bytes / MAXTEXT_BYTES,
    1.0,
    True,
    f"{describe(ours)} vs {maxtext}",
    common.machine(f"compiled by libtpu for {args.topology}"),
  )
  common.emit([row], args.json)


if __name__ == "__main__":
  main()
