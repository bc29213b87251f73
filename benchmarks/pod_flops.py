"""M2: does tensor parallelism add work? Compiled FLOPs per device on a pod, fsdp_tp ÷ pure FSDP.

  python -m benchmarks.pod_flops [--config=configs/llama3_8b.py] [--topology=v5p-256] [--json=out.json]

Compiles the real train step of the config (through `spmd-plan`'s
`make_plan`, the code `spmd-train` runs) for a TPU slice with libtpu, twice:
as shipped (`data=1,fsdp=-1,tensor=4` under `fsdp_tp` for llama3_8b) and as
pure FSDP over every device (`data=1,fsdp=-1,tensor=1` under `fsdp`). Same
model, batch and devices, so the ratio of their matmul FLOPs per device
(`spmd.hlo.matmul_flops`, every loop's iterations counted) is 1 unless
something is computed again on every device of the `tensor` axis. Goal:
at most 1.05. Either compile falling back to full copies of an array
("Involuntary full rematerialization") is said in the detail.

Nothing is timed, so the machine's load does not move the figure; each
compile takes minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os

import jax

jax.config.update("jax_platforms", "cpu")

from benchmarks import common  # noqa: E402
from trainers.planning import plan as plan_lib  # noqa: E402
from trainers.planning import targets  # noqa: E402

FSDP = ("data=1,fsdp=-1,tensor=1", "fsdp")


def compiled_flops(config, target) -> tuple[float, int]:
  """(compiled matmul FLOPs per device per step, fallbacks) of the config's train step."""
  plan = plan_lib.make_plan(config, target, compile_step=True, verify_suggestions=False)
  if plan.compute.compiled_flops is None:
    raise RuntimeError(f"{target.name}: the step did not compile ({plan.compile_error})")
  return plan.compute.compiled_flops, len(plan.fallbacks)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/llama3_8b.py")
  parser.add_argument("--topology", default="v5p-256")
  parser.add_argument("--json")
  args = parser.parse_args()
  with targets.own_libtpu_log_folder():
    target = targets.tpu_target(args.topology)
    shipped = common.load_config(args.config)
    fsdp = common.load_config(args.config)
    fsdp.mesh.ici, fsdp.mesh.rules = FSDP
    tp_flops, tp_fallbacks = compiled_flops(shipped, target)
    fsdp_flops, fsdp_fallbacks = compiled_flops(fsdp, target)
  name = os.path.basename(args.config)
  common.emit(
    [
      common.row(
        "M2",
        f"compiled FLOPs per device, {name} on {args.topology}: "
        f"{shipped.mesh.rules} ({shipped.mesh.ici}) ÷ pure FSDP",
        tp_flops / fsdp_flops,
        1.05,
        True,
        f"{tp_flops / 1e12:.1f} vs {fsdp_flops / 1e12:.1f} TFLOP per device per step; "
        f"fallbacks to full copies: {tp_fallbacks} and {fsdp_fallbacks}",
        common.machine(f"compiled by libtpu for {target.name}"),
      )
    ],
    args.json,
  )


if __name__ == "__main__":
  main()
