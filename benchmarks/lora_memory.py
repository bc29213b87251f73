"""L1: per-device bytes of LoRA ÷ full fine-tuning of Llama-3-8B on v5e-8, compiled ahead of time.

  python -m benchmarks.lora_memory [--json=out.json] [--config=configs/llama3_8b.py]
      [--topology=v5e-8] [--rank=16] [--seq-len=N --num-layers=N --global-batch=N]

Both sides are the step `spmd-plan` compiles through libtpu for the slice's
real device descriptions,

  spmd-plan --config=configs/llama3_8b.py --topology=v5e-8 \\
      --config.mesh.ici=data=1,fsdp=-1,tensor=1 --config.mesh.rules=fsdp \\
      --config.global_batch=8 [--config.lora.targets=q,k,v,o,gate,up,down --config.lora.rank=16]

at 8192 tokens, one row a device, full remat (`configs/llama3_8b.py`'s),
the bf16 policy: full fine-tuning (every weight float32 with its two Adam
moments) and LoRA (rank 16 on all seven projections, the rest frozen in
bf16, the built-in Llama adding `s (x A) B` itself). Each figure is the
plan's peak per device: the compiler's, or the requirement its refusal
names when the step does not fit. The ratio is LoRA's over full's.

Goal: full fine-tuning does not fit the v5e's 15.75 GiB and LoRA does, each
by the plan's own verdict (the compiler's, on a TPU target).
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
PURE_FSDP = {"ici": "data=1,fsdp=-1,tensor=1", "rules": "fsdp"}
TARGETS = "q,k,v,o,gate,up,down"
GOAL = "full does not fit, LoRA fits"


@dataclasses.dataclass(frozen=True)
class Pair:
  """The two plans of the same step: full fine-tuning's and LoRA's."""

  full: Plan
  lora: Plan

  @property
  def ratio(self) -> float:
    return self.lora.memory.total_bytes / self.full.memory.total_bytes

  @property
  def meets_goal(self) -> bool:
    return self.full.fits is False and self.lora.fits is True


def plan_for(args: argparse.Namespace, lora_targets: str) -> Plan:
  """The plan of the config under pure FSDP on the topology, one row a device."""
  config = common.load_config(args.config)
  config.mesh.ici, config.mesh.rules = PURE_FSDP["ici"], PURE_FSDP["rules"]
  for name, value in (("seq_len", args.seq_len), ("num_layers", args.num_layers)):
    if value:
      config.model[name] = value
  target = targets.tpu_target(args.topology)
  config.global_batch = args.global_batch or len(target.devices)  # one row a device
  config.lora.targets = lora_targets
  config.lora.rank = args.rank
  config.lora.alpha = 2.0 * args.rank
  return plan_lib.make_plan(config, target, compile_step=True, verify_suggestions=False)


def describe(plan: Plan) -> str:
  """A plan's bytes per device and its verdict, in a few words."""
  m = plan.memory
  verdict = {True: "fits", False: "does not fit", None: "unknown"}[plan.fits]
  return (
    f"{m.total_bytes / GIB:.2f} GiB ({m.params_bytes / GIB:.2f} GiB parameters, "
    f"{m.optimizer_bytes / GIB:.2f} GiB optimizer state), {verdict} (by the {plan.verdict_by})"
  )


def l1_row(pair: Pair, name: str, rank: int, where: str) -> dict:
  """L1's row: the ratio, both plans' bytes in its detail, its goal the two verdicts."""
  usable = pair.full.memory.usable_bytes
  r = common.row(
    "L1",
    f"bytes per device, LoRA (rank {rank} on the 7 projections) ÷ full fine-tuning, {name}",
    pair.ratio,
    None,
    True,
    f"LoRA {describe(pair.lora)}; full {describe(pair.full)}"
    + (f"; usable HBM {usable / GIB:.2f} GiB" if usable else ""),
    where,
  )
  return {**r, "goal": GOAL, "meets_goal": pair.meets_goal}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/llama3_8b.py")
  parser.add_argument("--topology", default="v5e-8")
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=0, help="shrink the model (tests)")
  parser.add_argument("--num-layers", type=int, default=0, help="shrink the model (tests)")
  parser.add_argument("--global-batch", type=int, default=0, help="default: one row a device")
  parser.add_argument("--json")
  args = parser.parse_args()
  pair = Pair(full=plan_for(args, ""), lora=plan_for(args, TARGETS))
  seq = args.seq_len or common.load_config(args.config).model.seq_len
  name = (
    f"{os.path.basename(args.config)} at {seq} tokens on {args.topology}, pure FSDP, "
    "one row a device"
  )
  where = common.machine(f"compiled by libtpu for {args.topology}")
  common.emit([l1_row(pair, name, args.rank, where)], args.json)


if __name__ == "__main__":
  main()
