"""The TPU check: the plan of the 501M Llama against what the chip's compiler and clock say.

  python -m benchmarks.tpu_check [--rows=8,12] [--steps=10] [--tuning=FILE] [--out=FILE]   # one TPU chip
  python -m benchmarks.tpu_check --tiny --sweep=2                         # its test, on a CPU

First it plans `configs/llama_tpu_check.py`'s step for `--topology` at every
row count from 1 to the first the compiler refuses (`--sweep`, at most 16)
and prints each one's figure beside its verdict: the compiler's peak, at
most the chip's HBM where the step fits, above it where it is refused.
Then for each row count of `--rows` it
  1. plans the train step for `--topology` (default v5e-1) as `spmd-plan`
     does: compiled by libtpu for the slice's description, nothing allocated;
  2. compiles the same step for this machine's device and reads the
     compiled program's `memory_analysis()` (on a TPU its peak, the figure
     `spmd-plan` reports); the compiler's refusal (RESOURCE_EXHAUSTED) is
     the device's verdict;
  3. where it compiled, runs it on synthetic batches and times the steps.

It reports PL1 = the plan's peak for a described v5e-1 / the chip's own
compiled peak (goal 0.97-1.03): that the slice's description is the real
chip, not a check of how memory is counted; whether the plan's verdict is
the device's at each row count, PL2: whether the measured step time lies
in the plan's range, and P9:
the MFU of the first row count's step (splash on a TPU). With
`--train_steps=N` (0: skip) it then trains the same Llama for N steps with
`train_and_evaluate`, what `spmd-train` runs, on the packed byte corpus
(splash with segment ids), and reports P4 = the run's tokens/s ÷ the raw
step's (goal >= 0.97). Then P11 (`benchmarks/tpu_llama.py`, `--p11_rows`,
0: skip): our step ÷ a hand-written `jax.jit` step of the same Llama with
the same kernel and remat (goal <= 1.02). `--trace_steps=N` names the
first row count's top ops from a `jax.profiler` trace; `--tuning=FILE`
applies a setting of `benchmarks/tpu_tuning.py` (or its report's best)
first. `python -m benchmarks.run --from-tpu-check=FILE --update-readme`
merges the JSON into the README's table.
Needs jax, flax, optax, orbax, ml_collections and libtpu: no data set.
Prints a table and writes the figures as JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import tpu_llama, tpu_tuning  # noqa: E402
from benchmarks.tpu_check_config import check_config  # noqa: E402
from spmd.layout import batch_sharding  # noqa: E402
from trainers.planning import plan as plan_lib  # noqa: E402
from trainers.planning.targets import tpu_target  # noqa: E402
from trainers.reporting import chips  # noqa: E402
from trainers.step.loss import abstract_batch  # noqa: E402
from trainers.step.mesh import build_mesh  # noqa: E402
from trainers.step.state import make_state  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402

GiB = 2**30


def planned(config, topology: str) -> dict:
  """What `spmd-plan --topology=TOPOLOGY` says of the step."""
  plan = plan_lib.make_plan(config, tpu_target(topology), verify_suggestions=False)
  m, c = plan.memory, plan.compute
  return {
    "fits": plan.fits,
    "verdict_by": plan.verdict_by,
    "total_bytes": m.total_bytes,
    "temp_bytes": m.temp_bytes,
    "device_bytes": m.device_bytes,
    "step_time_s_range": list(c.step_time_s) if c.step_time_s else None,
    "mfu_range": list(c.mfu) if c.mfu else None,
    "compile_error": plan.compile_error,
    "attention": plan.attention,
  }


def _synthetic_batch(task, rows: int, vocab: int, sharding) -> dict:
  rng = np.random.default_rng(0)
  out = {}
  for name, shape in abstract_batch(task, rows).items():
    if jnp.issubdtype(shape.dtype, jnp.integer):
      value = rng.integers(0, vocab, shape.shape).astype(shape.dtype)
    else:
      value = np.ones(shape.shape, shape.dtype)  # the mask: every token counts
    out[name] = jax.device_put(value, sharding)
  return out


def compiled_memory(compiled) -> dict:
  """The compiled step's memory analysis; `total_bytes` is what `spmd-plan` reports for it.

  On a TPU that is the compiler's peak; the sum of the other fields (which
  counts the state twice there) is kept beside it for comparison.
  """
  stats = compiled.memory_analysis()
  return {
    "total_bytes": plan_lib.step_bytes(stats, on_tpu=jax.devices()[0].platform == "tpu"),
    "peak_bytes": stats.peak_memory_in_bytes,
    "sum_bytes": plan_lib.step_bytes(stats, on_tpu=False),
    "temp_bytes": stats.temp_size_in_bytes,
    "argument_bytes": stats.argument_size_in_bytes,
    "output_bytes": stats.output_size_in_bytes,
    "alias_bytes": stats.alias_size_in_bytes,
    "code_bytes": stats.generated_code_size_in_bytes,
  }


def on_device(config, steps: int, warmup: int, trace_steps: int = 0) -> dict:
  """The step compiled for this machine's device: its memory analysis, then its time.

  With `trace_steps`, that many more steps are traced and their top ops named
  (`tpu_tuning.profile`).
  """
  task = make_task(config)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes, task.optimizer)
  step = make_train_step(setup, task, config, mesh, axes)
  sharding = batch_sharding(mesh, axes)
  state_shapes = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  started = time.perf_counter()
  try:
    compiled = step.lower(
      state_shapes, abstract_batch(task, config.global_batch, sharding)
    ).compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return {"compiled": False, "refusal": " ".join(str(e).split())[:400]}
  compile_s = time.perf_counter() - started
  out = {"compiled": True, "compile_s": compile_s, **compiled_memory(compiled)}
  batch = _synthetic_batch(task, config.global_batch, config.model.vocab_size, sharding)
  state = setup.init()
  for _ in range(warmup):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(state)
  started = time.perf_counter()
  for _ in range(steps):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(state)
  step_s = (time.perf_counter() - started) / steps
  device = jax.local_devices()[0]
  peak = chips.table_peak(device.device_kind, config.train.precision)
  memory = device.memory_stats() or {}
  out.update(
    step_s=step_s,
    tokens_per_s=config.global_batch * config.model.seq_len / step_s,
    mfu=task.flops_per_step / step_s / peak if peak else None,
    loss=float(metrics["loss"]),
    peak_bytes_in_use=memory.get("peak_bytes_in_use"),
    bytes_limit=memory.get("bytes_limit"),
  )
  if trace_steps:
    out["profile"], state = tpu_tuning.profile(
      compiled, state, batch, trace_steps, compiled.as_text()
    )
  return out


def through_the_trainer(
  rows: int, steps: int, workdir: str, tiny: bool = False, setting: dict | None = None
) -> dict:
  """`train_and_evaluate` of the same Llama on the packed byte corpus: its summary's rates."""
  from trainers.run.train import train_and_evaluate  # imports the data stack: only here

  config = tpu_tuning.configure(check_config(rows, tiny), setting or {})
  config.global_batch = rows
  config.data.pack = True
  config.train.steps = steps
  config.train.warmup_steps = min(config.train.warmup_steps, steps)
  config.log_every = max(1, steps // 6)
  config.eval_every = 0
  config.checkpoint.every = 0
  summary = train_and_evaluate(config, workdir)
  return {
    "steps": steps,
    "tokens_per_s": summary.get("tokens_per_s"),
    "mfu": summary.get("mfu"),
    "real_token_share": summary.get("real_token_share"),
    "train_loss": summary.get("train_loss"),
  }


def sweep(max_rows: int, topology: str, tiny: bool = False, setting: dict | None = None) -> dict:
  """The plan at every row count from 1 to the first it refuses (at most `max_rows`), by rows.

  Each row count's printed figure must agree with its verdict: at most the
  chip's HBM where the step fits, above it where the compiler refuses it.
  """
  plans = {}
  for rows in range(1, max_rows + 1):
    config = tpu_tuning.configure(check_config(rows, tiny), setting or {})
    config.global_batch = rows
    started = time.perf_counter()
    plans[rows] = planned(config, topology)
    print(f"{rows} rows, plan ({time.perf_counter() - started:.0f} s): {plans[rows]}", flush=True)
    if plans[rows]["fits"] is False:
      break
  return plans


def agrees_with_hbm(plan: dict) -> bool | None:
  """The plan's figure is at most the HBM where it fits and above it where it does not."""
  if plan["total_bytes"] is None or plan["device_bytes"] is None or plan["fits"] is None:
    return None
  return plan["fits"] == (plan["total_bytes"] <= plan["device_bytes"])


def sweep_table(plans: dict, topology: str) -> list[str]:
  """The sweep as lines: each row count's figure beside its verdict."""
  hbm = next(iter(plans.values()))["device_bytes"] if plans else None
  lines = [
    f"  the plan at each row count, {topology}"
    + (f" ({hbm / GiB:.2f} GiB HBM)" if hbm else "")
    + ": the compiler's peak, or its refusal's figure",
    f"  {'rows':>4}  {'plan':>10}  {'verdict':>14}  within HBM as the verdict says",
  ]
  for rows, p in plans.items():
    figure = f"{p['total_bytes'] / GiB:.2f} GiB" if p["total_bytes"] is not None else "-"
    verdict = {True: "fits", False: "does not fit"}.get(p["fits"], "unknown")
    agree = {True: "yes", False: "NO", None: "-"}[agrees_with_hbm(p)]
    lines.append(f"  {rows:>4}  {figure:>10}  {verdict:>14}  {agree}")
  return lines


def judge(plan: dict, device: dict) -> dict:
  """PL1, whether the verdicts agree, and PL2, from one row count's plan and device figures."""
  out = {"verdicts_agree": plan["fits"] == device["compiled"]}
  if device["compiled"] and plan["total_bytes"]:
    out["pl1"] = plan["total_bytes"] / device["total_bytes"]
  if device.get("step_s") and plan["step_time_s_range"]:
    low, high = plan["step_time_s_range"]
    out["pl2_in_range"] = low <= device["step_s"] <= high
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  # P9 and P4 at the first count: 8 rows, the most that XLA compiles for the
  # chip without recomputing to fit (`python -m benchmarks.remat_check`).
  parser.add_argument("--rows", default="8,12", help="row counts a step, comma separated")
  parser.add_argument("--topology", default="v5e-1", help="the slice the plan is for")
  parser.add_argument(
    "--sweep",
    type=int,
    default=16,
    help="plan every row count from 1 to the first refused, at most this many (0: skip)",
  )
  parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--out", default=os.environ.get("OUT", ".") + "/tpu_check.json")
  parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (the check's test)")
  parser.add_argument("--train_steps", type=int, default=0, help="P4's run (0: skip it)")
  parser.add_argument("--workdir", default="/tmp/spmd_tpu_check", help="P4's run's workdir")
  parser.add_argument(
    "--trace_steps", type=int, default=0, help="profile the first row count's step"
  )
  parser.add_argument("--p11_rows", type=int, default=2, help="P11's rows (0: skip P11)")
  parser.add_argument("--p11_rounds", type=int, default=6)
  parser.add_argument(
    "--tuning", default="", help="a setting, or benchmarks.tpu_tuning's report: its best"
  )
  args = parser.parse_args(argv)
  setting = {}
  if args.tuning:
    setting = json.loads(Path(args.tuning).read_text())
    setting = setting.get("best", setting)
    tpu_tuning.apply(setting)
  device = jax.local_devices()[0]
  report = {
    "jax": jax.__version__,
    "device_kind": device.device_kind,
    "topology": args.topology,
    "date": time.strftime("%Y-%m-%d"),
    "command": " ".join(["benchmarks/tpu_check.sh", *(argv if argv is not None else sys.argv[1:])]),
    "tuning": setting,
    "rows": {},
  }
  print(f"jax {jax.__version__} on {jax.devices()}", flush=True)
  row_counts = [int(r) for r in args.rows.split(",")]
  if "rows" in setting and int(setting["rows"]) not in row_counts:
    row_counts.insert(0, int(setting["rows"]))  # P9 at the tuned batch
  swept = sweep(args.sweep, args.topology, args.tiny, setting)
  report["sweep"] = {
    rows: {**plan, "agrees_with_hbm": agrees_with_hbm(plan)} for rows, plan in swept.items()
  }
  for rows in row_counts:
    config = tpu_tuning.configure(check_config(rows, args.tiny), setting)
    config.global_batch = rows
    started = time.perf_counter()
    plan = swept.get(rows) or planned(config, args.topology)
    print(f"{rows} rows, plan ({time.perf_counter() - started:.0f} s): {plan}", flush=True)
    trace = args.trace_steps if rows == row_counts[0] else 0
    measured = on_device(config, args.steps, args.warmup, trace_steps=trace)
    print(f"{rows} rows, on {device.device_kind}: {measured}", flush=True)
    report["rows"][rows] = {"plan": plan, "device": measured, **judge(plan, measured)}
  first = report["rows"][next(iter(report["rows"]))]["device"]
  report["p9_mfu"] = first.get("mfu")
  if args.train_steps and first.get("tokens_per_s"):
    rows = next(iter(report["rows"]))
    trained = through_the_trainer(rows, args.train_steps, args.workdir, args.tiny, setting)
    print(f"spmd-train's step, {rows} rows, packed: {trained}", flush=True)
    report["trainer"] = trained
    if trained["tokens_per_s"]:
      report["p4"] = trained["tokens_per_s"] / first["tokens_per_s"]
  # Both P11 states share the chip: where they and a step's temporaries do
  # not fit, half the rows.
  for rows in (args.p11_rows, args.p11_rows // 2) if args.p11_rows else ():
    config = tpu_tuning.configure(check_config(rows, args.tiny), setting)
    config.global_batch = rows
    try:
      report["p11"] = tpu_llama.compare(config, args.p11_rounds, steps=2)
    except jax.errors.JaxRuntimeError as e:
      report["p11"] = {"rows": rows, "error": " ".join(str(e).split())[:300]}
    print(f"P11, {rows} rows: {report['p11']}", flush=True)
    if "error" not in report["p11"] or rows < 2:
      break
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(report, indent=1, default=str))
  print(f"\ntpu check on {device.device_kind}, plan for {args.topology} (jax {jax.__version__})")
  print(
    f"  {'rows':>4}  {'plan':>22}  {'device':>22}  {'PL1':>6}  {'step':>9}  {'plan range':>17}  PL2"
  )
  for rows, r in report["rows"].items():
    p, d = r["plan"], r["device"]
    plan_word = ("fits" if p["fits"] else "does not fit") + (
      f" {p['total_bytes'] / GiB:.2f} GiB" if p["total_bytes"] else ""
    )
    device_word = f"runs {d['total_bytes'] / GiB:.2f} GiB" if d["compiled"] else "refused"
    step = f"{d['step_s'] * 1e3:.0f} ms" if d.get("step_s") else "-"
    span = p["step_time_s_range"]
    span = f"{span[0] * 1e3:.0f}-{span[1] * 1e3:.0f} ms" if span else "-"
    pl1 = f"{r['pl1']:.3f}" if "pl1" in r else "-"
    pl2 = {True: "yes", False: "NO"}.get(r.get("pl2_in_range"), "-")
    agree = "" if r["verdicts_agree"] else "  (VERDICTS DISAGREE)"
    print(
      f"  {rows:>4}  {plan_word:>22}  {device_word:>22}  {pl1:>6}  {step:>9}  {span:>17}  {pl2}{agree}"
    )
  for line in sweep_table(swept, args.topology):
    print(line)
  if report["p9_mfu"] is not None:
    print(f"  P9  MFU of the step, splash: {report['p9_mfu']:.1%} (goal >= 62%)")
  if "p4" in report:
    t = report["trainer"]
    print(
      f"  P4  spmd-train's tokens/s / the raw step's: {report['p4']:.3f} (goal >= 0.97): "
      f"{t['tokens_per_s']:,.0f} vs {first['tokens_per_s']:,.0f}, "
      f"{(t['real_token_share'] or 0):.1%} real tokens"
    )
  p11 = report.get("p11", {})
  if "p11" in p11:
    print(
      f"  P11 our step / a hand-written jax.jit step, {p11['rows']} rows: {p11['p11']:.3f} "
      f"(goal <= 1.02): {p11['ours_step_s'] * 1e3:.1f} vs {p11['hand_step_s'] * 1e3:.1f} ms"
    )
  elif p11:
    print(
      f"  P11 the losses disagree: ours {p11['losses_ours']}, hand-written {p11['losses_hand']}"
    )
  print(f"  written to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
