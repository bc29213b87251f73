"""M1: per-device memory of Llama-3-8B on v5p-256 under pure FSDP ÷ MaxText's, compiled ahead of time.

  python -m benchmarks.pod_memory [--json=out.json] [--config=configs/llama3_8b.py]
      [--topology=v5p-256] [--seq-len=N --num-layers=N --global-batch=N]

Both sides are one field of the compiled program's `memory_analysis()`, the
one MaxText prints: its "Total memory size", arguments + outputs - aliased +
temporaries (`MAXTEXT_FIELD`). Ours is that field of the step `spmd-plan`
compiles for

  spmd-plan --config=configs/llama3_8b.py --topology=v5p-256 \\
      --config.mesh.ici=data=1,fsdp=-1,tensor=1 --config.mesh.rules=fsdp

through libtpu for the slice's real device descriptions, with the model's
attention kernel as "auto" gives it on TPU (splash) and the task's chunked
cross-entropy; the row also gives the plan's own figure, the compiler's
peak, which is not MaxText's field (MaxText 0.2.5 does not print a peak).
The same plan with `--config.model.attention=xla` is the second row
(M1-xla), for what the kernel saves.

MaxText's side is a constant, `MAXTEXT_BYTES`: MaxText 0.2.5's own ahead-of-time
compile of the same model, batch and target (`MAXTEXT_COMMAND`), with its
defaults (FSDP, scanned layers, full remat, bf16, its TPU attention): its
`print_compiled_memory_stats` line, 13.37 GiB of temporaries and 0.70 GiB
of arguments, 14.1 GiB per device. It is not
recomputed here: MaxText stays out of this project's dependencies.

Goal: 1.0 (as much memory as MaxText needs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import jax

jax.config.update("jax_platforms", "cpu")

from benchmarks import common  # noqa: E402
from trainers.planning import plan as plan_lib  # noqa: E402
from trainers.planning import targets  # noqa: E402
from trainers.planning.figures import Plan  # noqa: E402

GIB = 2**30
MAXTEXT_BYTES = 14.1 * GIB
"""MaxText 0.2.5's "Total memory size" for Llama-3-8B, 8192 tokens, global batch 256, v5p-256."""
MAXTEXT_FIELD = "arguments + outputs - aliased + temporaries"
"""What MaxText's `max_utils.print_compiled_memory_stats` adds up from `memory_analysis()`."""
MAXTEXT_COMMAND = (
  'pip install "maxtext[tpu]==0.2.5"  # in a Python 3.12 venv; then:\n'
  "python -m maxtext.trainers.pre_train.train_compile <its configs/base.yml> "
  "compile_topology=v5p-256 compile_topology_num_slices=1 model_name=llama3-8b "
  "per_device_batch_size=2 max_target_length=8192 run_name=aot base_output_directory=OUT"
)
"""How `MAXTEXT_BYTES` was measured: it prints `Memory analysis` (temporaries + arguments)."""
PURE_FSDP = {"ici": "data=1,fsdp=-1,tensor=1", "rules": "fsdp"}


def maxtext_total(stats) -> int:
  """MaxText's "Total memory size" of a compiled program (`MAXTEXT_FIELD`)."""
  return (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )


@dataclasses.dataclass(frozen=True)
class Compiled:
  """A plan, and MaxText's field of the program it compiled."""

  plan: Plan
  maxtext_field_bytes: int


def plan_for(args: argparse.Namespace, attention: str) -> Compiled:
  """The plan of the config under pure FSDP on the topology, with this attention kernel."""
  config = common.load_config(args.config)
  config.mesh.ici, config.mesh.rules = PURE_FSDP["ici"], PURE_FSDP["rules"]
  config.model.attention = attention
  for name, value in (("seq_len", args.seq_len), ("num_layers", args.num_layers)):
    if value:
      config.model[name] = value
  if args.global_batch:
    config.global_batch = args.global_batch
  return compiled_plan(config, args.topology)


def compiled_plan(config, topology: str) -> Compiled:
  """`spmd-plan`'s plan of `config` compiled through libtpu for `topology`, and MaxText's field of it."""
  compiled: list = []
  plan = plan_lib.make_plan(
    config,
    targets.tpu_target(topology),
    compile_step=True,
    verify_suggestions=False,
    keep_compiled=compiled,
  )
  return Compiled(plan, maxtext_total(compiled[0].memory_analysis()))


def describe(ours: Compiled) -> str:
  m = ours.plan.memory
  kernel = ours.plan.attention[0].split()[0] if ours.plan.attention else "none"
  return (
    f"{kernel}: {ours.maxtext_field_bytes / GIB:.2f} GiB ({m.temp_bytes / GIB:.2f} GiB "
    f"temporaries, {m.state_bytes / GIB:.2f} GiB parameters and optimizer state; "
    f"the plan's peak {m.total_bytes / GIB:.2f} GiB)"
  )


def plan_arguments(description: str, config: str) -> argparse.Namespace:
  """The command line of a pod-memory figure: `--config` (default `config`), `--topology`, the
  shrinking flags its test passes and `--json`."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--config", default=config)
  parser.add_argument("--topology", default="v5p-256")
  parser.add_argument("--seq-len", type=int, default=0, help="shrink the model (tests)")
  parser.add_argument("--num-layers", type=int, default=0, help="shrink the model (tests)")
  parser.add_argument("--global-batch", type=int, default=0, help="shrink the batch (tests)")
  parser.add_argument("--json")
  return parser.parse_args()


def main() -> None:
  args = plan_arguments(__doc__.splitlines()[0], "configs/llama3_8b.py")
  fused = plan_for(args, "auto")
  xla = plan_for(args, "xla")
  name = f"{os.path.basename(args.config)} on {args.topology}, pure FSDP"
  where = common.machine(f"compiled by libtpu for {args.topology}")
  maxtext = f"MaxText {MAXTEXT_BYTES / GIB:.1f} GiB, both {MAXTEXT_FIELD}"
  rows = [
    common.row(
      "M1",
      f"bytes per device, {name} ÷ MaxText's (its own AOT compile)",
      fused.maxtext_field_bytes / MAXTEXT_BYTES,
      1.0,
      True,
      f"{describe(fused)} vs {maxtext}; chunked loss",
      where,
    ),
    common.row(
      "M1-xla",
      "M1 with `model.attention=xla` (the scores written out)",
      xla.maxtext_field_bytes / MAXTEXT_BYTES,
      None,
      True,
      f"{describe(xla)} vs {maxtext}; chunked loss",
      where,
    ),
  ]
  common.emit(rows, args.json)


if __name__ == "__main__":
  main()
