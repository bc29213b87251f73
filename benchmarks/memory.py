"""P7: what FSDP saves per device, from the compiled program's own memory analysis.

  python -m benchmarks.memory [--config=configs/lm_small.py] [--devices=8] [--json=out.json]

Compiles the real train step (through `spmd-plan`'s `make_plan`, the same
code as `spmd-train`) twice for N CPU devices: data parallel (state
replicated) and FSDP over all N. The per-device parameter + optimizer bytes
are the compiled step's argument bytes less the batch's. Goal: FSDP ÷
(replicated ÷ N) <= 1.05, i.e. sharding loses at most 5% to what stays
replicated (norm scales, counters) or pads.
"""

from __future__ import annotations

import argparse
import os

import jax

DEVICES = int(os.environ.get("BENCH_DEVICES", "8"))
jax.config.update("jax_num_cpu_devices", DEVICES)
jax.config.update("jax_platforms", "cpu")

from benchmarks import common  # noqa: E402
from trainers.planning import plan as plan_lib  # noqa: E402
from trainers.planning import targets  # noqa: E402


def state_bytes_per_device(config, devices: int) -> tuple[int, int]:
  """(from the compiled memory analysis, from the shardings) parameter + optimizer bytes."""
  keep: list = []
  plan = plan_lib.make_plan(
    config, targets.gpu_target("h100", devices), compile_step=True, keep_compiled=keep
  )
  compiled = keep[0].memory_analysis().argument_size_in_bytes - plan.memory.batch_bytes
  return compiled, plan.memory.state_bytes


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/lm_small.py")
  parser.add_argument("--json")
  args = parser.parse_args()
  replicated_config = common.load_config(args.config)
  replicated_config.mesh.rules, replicated_config.mesh.ici = "dp", "data=-1"
  fsdp_config = common.load_config(args.config)
  fsdp_config.mesh.rules, fsdp_config.mesh.ici = "fsdp", f"data=1,fsdp={DEVICES},tensor=1"
  replicated, _ = state_bytes_per_device(replicated_config, DEVICES)
  fsdp, fsdp_from_shardings = state_bytes_per_device(fsdp_config, DEVICES)
  ratio = fsdp / (replicated / DEVICES)
  mib = 2**20
  common.emit(
    [
      common.row(
        "P7",
        f"parameter + optimizer bytes per device, FSDP over {DEVICES} ÷ (replicated ÷ {DEVICES})",
        ratio,
        1.05,
        True,
        f"{os.path.basename(args.config)}: {fsdp / mib:.1f} MiB vs {replicated / mib:.1f} MiB "
        f"replicated (shardings say {fsdp_from_shardings / mib:.1f} MiB)",
        common.machine(f"{DEVICES} CPU devices, compiled"),
      )
    ],
    args.json,
  )


if __name__ == "__main__":
  main()
