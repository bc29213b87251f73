"""P9 at more shapes: the MFU of Llamas that fill one v5e chip, measured through `spmd-train`.

  benchmarks/tpu_shapes.sh [--shapes=mha,long] [--steps=24]   # one TPU chip, a few minutes
  python -m benchmarks.tpu_shapes --plan --steps=0              # the plan alone, any machine
  python -m benchmarks.tpu_shapes --tiny --steps=4              # its test, on a CPU

The shapes (`SHAPES`), each a config beside the TPU check's:
  mha   configs/llama_tpu_shape_mha.py    P9-mha   no grouped-query attention
  long  configs/llama_tpu_shape_long.py   P9-long  4096-token sequences
  moe   configs/llama_tpu_shape_moe.py    E-P9     8 routed experts, top 2 (MFU on
                                                   the active parameters' FLOPs)

For each shape it runs `train_and_evaluate`, what `spmd-train` runs, for
`--steps` steps on the packed byte corpus (splash with segment ids), as
P4-tpu does (`benchmarks/tpu_check.py`), and reads the run's own `mfu`
from its metrics.jsonl: the median over the steps after the first log
interval, which holds the compile. With `--plan` it first compiles the
step for `--topology` (default v5e-1) as `spmd-plan` does and reports the
compiler's peak, its verdict and the instructions XLA rematerialized to
fit (`benchmarks/remat_check.py`), with the model FLOPs of a step and the
step time they would take at 60 % MFU. It prints a table and writes JSON
(`--out`) that
  python -m benchmarks.run --from-tpu-check=FILE --only=P9-mha,P9-long,E-P9 --update-readme
merges into `benchmarks/latest.json` and the README's table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.remat_check import remat_count  # noqa: E402
from benchmarks.tpu_check_config import TINY  # noqa: E402
from spmd.errors import UserError  # noqa: E402
from trainers.config import resolve  # noqa: E402
from trainers.models.llama import param_count  # noqa: E402
from trainers.planning import plan as plan_lib  # noqa: E402
from trainers.planning.targets import tpu_target  # noqa: E402
from trainers.reporting import chips  # noqa: E402
from trainers.tasks import make_task  # noqa: E402
from trainers.tasks.llama import llama_config  # noqa: E402

GOAL = 0.58  # issue 60: each dense shape's MFU through spmd-train
MOE_GOAL = 0.40  # issue 63: twice the 17-22 % Marin's small Mixtral reached
AT_MFU = 0.6  # the MFU the plan's predicted step time assumes


@dataclasses.dataclass(frozen=True)
class Shape:
  """A Llama shape of the benchmark: its figure id, config module and CPU-sized variant."""

  figure: str
  config: str  # a module of configs/
  label: str  # what makes it this shape, for the table
  tiny: dict  # `--tiny`: the model fields, keeping what makes it this shape
  goal: float = GOAL


# `--tiny`'s rows a step: one a device of the suite's 8 CPU devices, whatever
# the shape takes on the chip.
TINY_ROWS = 8
SHAPES = {
  "mha": Shape(
    "P9-mha", "llama_tpu_shape_mha", "without GQA", {**TINY, "num_kv_heads": TINY["num_heads"]}
  ),
  "long": Shape("P9-long", "llama_tpu_shape_long", "GQA", {**TINY, "seq_len": 2 * TINY["seq_len"]}),
  "moe": Shape(
    "E-P9",
    "llama_tpu_shape_moe",
    "with 8 experts, top 2",
    {**TINY, "moe_experts": 4, "moe_top_k": 2, "moe_d_ff": TINY["d_ff"] // 2},
    goal=MOE_GOAL,
  ),
}


def shape_config(name: str, tiny: bool = False) -> ml_collections.ConfigDict:
  """The checked config of shape `name` (`--tiny`: CPU-sized).

  Example:
    >>> config = shape_config("mha", tiny=True)
    >>> config.model.num_kv_heads == config.model.num_heads, config.global_batch
    (True, 8)
  """
  if name not in SHAPES:
    raise ValueError(f"shape {name!r} is not one of {sorted(SHAPES)}")
  module = SHAPES[name].config
  config = importlib.import_module(f"configs.{module}").get_config()
  if tiny:
    config.model.update(SHAPES[name].tiny)
    config.global_batch = TINY_ROWS
  return resolve(config, ROOT / "configs" / f"{module}.py")


def facts(config: ml_collections.ConfigDict) -> dict:
  """What the shape is: sizes, rows, parameters and model FLOPs a step."""
  m = config.model
  return {
    "params": param_count(llama_config(config)),
    "rows": config.global_batch,
    "seq_len": m.seq_len,
    "num_layers": m.num_layers,
    "d_model": m.d_model,
    "num_heads": m.num_heads,
    "num_kv_heads": m.num_kv_heads,
    "d_ff": m.d_ff,
    "moe_experts": m.get("moe_experts", 0),
    "moe_top_k": m.get("moe_top_k", 0),
    "remat_policy": m.remat_policy,
    "flops_per_step": make_task(config).flops_per_step,
  }


def planned(config: ml_collections.ConfigDict, topology: str) -> dict:
  """The step compiled for `topology` as `spmd-plan` does: peak, verdict, XLA's remats."""
  target = tpu_target(topology)
  kept: list = []
  started = time.perf_counter()
  plan = plan_lib.make_plan(
    config, target, compile_step=True, keep_compiled=kept, verify_suggestions=False
  )
  peak = chips.table_peak(target.device_kind, config.train.precision)
  flops = make_task(config).flops_per_step
  return {
    "topology": topology,
    "fits": plan.fits,
    "total_bytes": plan.memory.total_bytes,
    "device_bytes": plan.memory.device_bytes,
    "remats": remat_count(kept[0].as_text()) if kept else None,
    "attention": plan.attention,
    f"step_s_at_{AT_MFU}_mfu": flops / (AT_MFU * peak) if peak else None,
    "compile_s": time.perf_counter() - started,
  }


def steady_rows(rows: list[dict], log_every: int) -> list[dict]:
  """The train rows after the first log interval: its step time holds the compile.

  Example:
    >>> rows = [{"step": s, "step_time_s": 9.0 if s <= 2 else 1.0} for s in range(1, 7)]
    >>> [r["step"] for r in steady_rows(rows + [{"step": 6, "eval_loss": 2.0}], 2)]
    [3, 4, 5, 6]
  """
  return [r for r in rows if "step_time_s" in r and r["step"] > log_every]


def through_spmd_train(config: ml_collections.ConfigDict, steps: int, workdir: Path) -> dict:
  """`train_and_evaluate` of `config` for `steps` steps on packed bytes: its steady-state rates."""
  from trainers.reporting.metrics import read_metrics
  from trainers.run.train import train_and_evaluate  # imports the data stack: only here

  config.data.pack = True
  config.train.steps = steps
  config.train.warmup_steps = min(config.train.warmup_steps, steps)
  config.log_every = max(1, steps // 6)
  config.eval_every = 0
  config.eval_batches = 1
  config.checkpoint.every = 0
  # A fresh run each time: the checkpoint a run saves at its end would resume the next.
  shutil.rmtree(workdir, ignore_errors=True)
  summary = train_and_evaluate(config, str(workdir))
  shutil.rmtree(workdir / "checkpoints", ignore_errors=True)  # float32 state: gigabytes
  rows = steady_rows(read_metrics(workdir / "metrics.jsonl"), config.log_every)
  if not rows or "mfu" not in rows[0]:
    raise RuntimeError(
      f"{workdir}/metrics.jsonl has no MFU after step {config.log_every} of {steps}: "
      "--steps must be at least 2 and the device's peak known"
    )
  return {
    "steps": steps,
    "steps_timed": len(rows),
    "mfu": float(np.median([r["mfu"] for r in rows])),
    "step_s": float(np.median([r["step_time_s"] for r in rows])),
    "tokens_per_s": float(np.median([r["tokens_per_s"] for r in rows])),
    "summary_mfu": summary.get("mfu"),  # the run's median over every row, compile included
    "peak_source": summary.get("peak_source"),
    "real_token_share": summary.get("real_token_share"),
    "train_loss": summary.get("train_loss"),
    "wall_s": summary.get("wall_time_s"),
  }


def measure(name: str, args: argparse.Namespace) -> dict:
  """One shape's entry of the report: its facts, its plan (`--plan`), its run (`--steps`)."""
  config = shape_config(name, args.tiny)
  config.compilation_cache_dir = args.cache_dir or config.compilation_cache_dir
  if args.data_source:
    config.data.source = args.data_source
  config.data.dir = str(Path(args.workdir) / "data")  # one corpus for every shape
  out = {
    "figure": SHAPES[name].figure,
    "goal": SHAPES[name].goal,
    "config": f"configs/{SHAPES[name].config}.py",
    "label": SHAPES[name].label,
    **facts(config),
  }
  if args.plan:
    out["plan"] = planned(config, args.topology)
    print(f"{name}: plan {out['plan']}", flush=True)
  if args.steps:
    # A shape the chip refuses is said in its entry, and the next shape still runs.
    try:
      out.update(through_spmd_train(config, args.steps, Path(args.workdir) / name))
    except (UserError, jax.errors.JaxRuntimeError) as e:
      out["error"] = " ".join(str(e).split())[:600]
    print(f"{name}: spmd-train {out}", flush=True)
  gc.collect()  # the run's state goes before the next shape's is made
  return out


def _shape_names(text: str) -> list[str]:
  names = [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in SHAPES]
  if not names or unknown:
    raise argparse.ArgumentTypeError(f"--shapes={text!r}: each must be one of {sorted(SHAPES)}")
  return names


def table(report: dict) -> list[str]:
  """The report as lines: each shape's size, plan and MFU."""
  lines = [
    f"\nP9 at other shapes on {report['device_kind']} (jax {report['jax']}), goals: dense >= "
    f"{GOAL:.0%}, mixture of experts >= {MOE_GOAL:.0%} (on active parameters)",
    f"  {'figure':<8} {'params':>7} {'rows x seq':>11} {'plan':>18} {'remats':>6} "
    f"{'step':>9} {'MFU':>6}",
  ]
  for s in report["shapes"].values():
    plan = s.get("plan", {})
    plan_word = (
      ("fits " if plan["fits"] else "refused ") + f"{plan['total_bytes'] / 2**30:.2f} GiB"
      if plan.get("total_bytes")
      else "-"
    )
    remats = plan.get("remats")
    step = f"{s['step_s'] * 1e3:.1f} ms" if "step_s" in s else "error" if "error" in s else "-"
    mfu = f"{s['mfu']:.1%}" if "mfu" in s else "-"
    lines.append(
      f"  {s['figure']:<8} {s['params'] / 1e6:>6.0f}M {s['rows']:>4} x {s['seq_len']:<4} "
      f"{plan_word:>18} {'-' if remats is None else remats:>6} {step:>9} {mfu:>6}"
    )
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", type=_shape_names, default=list(SHAPES), help="e.g. mha,long")
  parser.add_argument("--steps", type=int, default=24, help="spmd-train's steps a shape (0: none)")
  parser.add_argument("--plan", action="store_true", help="first plan each shape for --topology")
  parser.add_argument("--topology", default="v5e-1")
  parser.add_argument("--tiny", action="store_true", help="CPU-sized shapes (the test)")
  parser.add_argument("--workdir", default="/tmp/spmd_tpu_shapes", help="the runs and their data")
  parser.add_argument("--data_source", default="", help="data.source (default: the stdlib)")
  parser.add_argument("--cache_dir", default="", help="the compilation cache (default: config's)")
  parser.add_argument("--out", default=os.environ.get("OUT", ".") + "/tpu_shapes.json")
  args = parser.parse_args(argv)
  if args.steps == 1 or args.steps < 0:
    parser.error(f"--steps={args.steps}: 0 (plan only) or at least 2 (one to compile, one timed)")
  device = jax.local_devices()[0]
  report = {
    "jax": jax.__version__,
    "device_kind": device.device_kind,
    "date": time.strftime("%Y-%m-%d"),
    "command": " ".join(
      ["benchmarks/tpu_shapes.sh", *(argv if argv is not None else sys.argv[1:])]
    ),
    "shapes": {},
  }
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  for name in args.shapes:
    report["shapes"][name] = measure(name, args)
    # After each shape: a run stopped by its time limit keeps the shapes it measured.
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
  for line in table(report):
    print(line)
  print(f"  written to {args.out}")
  failed = [n for n, s in report["shapes"].items() if "error" in s]
  for name in failed:
    print(f"  {name}: {report['shapes'][name]['error']}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
