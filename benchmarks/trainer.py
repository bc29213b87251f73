"""The trainer's step against a hand-written `jax.jit` step, and MFU.

  python -m benchmarks.trainer [--rounds=10] [--json=out.json]
  # on one GPU (the issue's H200 check): lm_small in bf16, MFU against the
  # chip's dense bf16 peak from `trainers.reporting.peaks` (989 TFLOP/s on H100/H200 SXM)
  BENCH_PLATFORM=cuda python -m benchmarks.trainer --model=lm_small --json=gpu.json

One process, in one run:
  P1  trainer step time ÷ hand-written step time: the same model, shardings,
      optimizer and batch; alternating rounds, median of per-round ratios.
      Goal <= 1.02. The hand-written step is what an expert writes without
      the harness: value_and_grad, optax update, jax.jit with shardings and
      donation (no NaN guard, no extra metrics).
  P3  model FLOP/s ÷ peak. On CPU (`BENCH_DEVICES` devices, default 4;
      `make bench` reports P1 from 4 devices and P3 from 1): lm_tiny at width
      512 against the float32 matmul peak measured in the same run, the best
      of 3 square 2048 matmuls just before each round, and the round's step
      time against it; median of the per-round ratios. Goal >= 0.75.
      The peak is the better of XLA:CPU's default matmul and the same matmul
      through oneDNN (`matmul_peak.ONEDNN_DOTS`; which is faster depends on the
      CPU); the detail also gives the figure against the default's alone.
      Beside it, the same estimate for a "step" of nothing but square 2048
      matmuls (as many FLOPs as lm_tiny's step, XLA's default matmul),
      timed in the same rounds: about the most a step can score here, since
      the peak is the best of 3 runs and a step's time is the mean of several.
      And on one device, the step's own matmuls alone: every dot of the
      compiled step (`spmd.hlo.dots`: shapes, dimension numbers, count) and
      nothing else (`common.dots_alone_step`), timed in the same rounds and
      scored with the step's model FLOPs: what P3 would be if everything
      but the matmuls were free.
      On an accelerator (`BENCH_PLATFORM=cuda` or `tpu`, every local device):
      against the chip's dense peak for the model's dtype from the table in
      `trainers.reporting.peaks` (a sampled matmul where the chip is not in it), with
      tokens/s; rows `P1-cuda` and `P3-cuda` (`-tpu` on TPU), no goal for the MFU.
`--global-batch`, `--seq-len` and `--num-layers` shrink the model, and
`--matmul-size` the square matmuls of the CPU's peak and of the matmul-only
step, for a quick check that the script runs (`tests/test_benchmarks.py`
runs it so on CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax

PLATFORM = os.environ.get("BENCH_PLATFORM", "cpu")
DEVICES = int(os.environ.get("BENCH_DEVICES", "4"))
if PLATFORM == "cpu":
  jax.config.update("jax_num_cpu_devices", DEVICES)
jax.config.update("jax_platforms", PLATFORM)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks import common  # noqa: E402
from configs import lm_small, lm_tiny_bytes  # noqa: E402
from spmd import hlo  # noqa: E402
from spmd.mesh import create_mesh  # noqa: E402
from trainers.models import transformer as lm  # noqa: E402
from trainers.reporting import chips, matmul_peak  # noqa: E402
from trainers.step.state import model_from_params  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402


def hand_written_step(setup, mesh, batch_spec):
  """What one writes by hand: no harness, same model, shardings and optimizer."""

  def loss_fn(params, batch):
    logits = model_from_params(setup, params)(batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt_state = setup.tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
    return new, {"loss": loss}

  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  batch_shardings = {k: batch_spec for k in ("inputs", "targets", "mask")}
  return jax.jit(
    step,
    in_shardings=(setup.shardings, batch_shardings),
    out_shardings=(setup.shardings, replicated),
    donate_argnums=0,
  )


def timed(step, state, batch, n):
  start = time.perf_counter()
  for _ in range(n):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  return state, (time.perf_counter() - start) / n


MODELS = ("lm_tiny_512", "lm_small")


def model_config_for(args: argparse.Namespace):
  """The experiment config of `--model`, with the size overrides applied."""
  if args.model == "lm_small":
    config = lm_small.get_config()
  else:  # lm_tiny at width 512: big enough for matmuls to dominate on a CPU
    config = lm_tiny_bytes.get_config()
    config.model.d_model, config.model.num_heads, config.model.d_ff = 512, 8, 2048
  if args.global_batch is not None:
    config.global_batch = args.global_batch
  if args.seq_len is not None:
    config.model.seq_len = args.seq_len
  if args.num_layers is not None:
    config.model.num_layers = args.num_layers
  return config


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=MODELS, default=MODELS[0])
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--steps", type=int, default=5, help="steps per round and side")
  parser.add_argument("--global-batch", type=int)
  parser.add_argument("--seq-len", type=int)
  parser.add_argument("--num-layers", type=int)
  parser.add_argument(
    "--matmul-size",
    type=int,
    default=2048,
    help="side of the square matmuls of the CPU's peak and the matmul-only step (tests shrink it)",
  )
  parser.add_argument("--json")
  args = parser.parse_args()

  config = model_config_for(args)
  mesh = create_mesh("data=-1")
  batch_axes = ("data",)
  setup, model_config, batch = common.transformer_setup(config, mesh, batch_axes)
  shape = batch["inputs"].shape
  ours = make_train_step(setup, make_task(config), config, mesh, batch_axes)
  theirs = hand_written_step(setup, mesh, batch["inputs"].sharding)
  state_a, state_b = setup.init(), setup.init()
  for _ in range(2):  # compile and warm up both
    state_a, _ = timed(ours, state_a, batch, 2)
    state_b, _ = timed(theirs, state_b, batch, 2)
  tokens = shape[0] * shape[1]
  flops = lm.flops_per_token(model_config) * tokens
  devices = mesh.devices.size
  # On CPU the peak is sampled in every round, next to the steps it is
  # compared with: on a shared machine the matmul peak itself moves within a
  # run as much as the step does, so a peak measured once, at another moment,
  # would make the ratio swing more than any change to the step does.
  # An accelerator's is the vendor's dense peak for the model's dtype.
  # CPU devices share the host's cores, so the host's peak is all of theirs.
  kind = jax.devices()[0].device_kind
  on_cpu = PLATFORM == "cpu"
  table = None if on_cpu else chips.table_peak(kind, config.train.precision)
  peak_devices = 1 if on_cpu else devices
  if table is None:
    # On CPU, XLA's default matmul is not always the fastest float32 matmul
    # this jaxlib has: through oneDNN the same square matmul can be faster,
    # depending on the CPU. A peak is the best the machine does, so each
    # round's is the better of the two (`matmul_peak.peak_sampler`).
    size = args.matmul_size if on_cpu else None  # an accelerator's own default
    sample_peak = matmul_peak.peak_sampler("float32" if on_cpu else config.train.precision, size)
    chain, chain_state, chain_flops = common.square_matmul_step(flops, args.matmul_size)
    chain_state, _ = timed(chain, chain_state, None, 1)  # compile; not timed
  # On one CPU device: the step's own dots, nothing else, timed like the step.
  # Its score is what P3 would be if all but the matmuls were free.
  replay = None
  if on_cpu and devices == 1:
    dots = hlo.dots(ours.lower(state_a, batch).compile().as_text())
    replay, replay_state, _ = common.dots_alone_step(dots)
    replay_state, _ = timed(replay, replay_state, None, 1)  # compile; not timed
  mfu_replay = []
  ratios, times_a, times_b, peaks_seen, mfu_a, mfu_b, mfu_chain = [], [], [], [], [], [], []
  default_peaks, mfu_default_peak = [], []
  for i in range(args.rounds):
    if table is None:
      best, default_peak = sample_peak(3, 1.0)
      peak = best * peak_devices
      default_peaks.append(default_peak * peak_devices)
      chain_state, c = timed(chain, chain_state, None, args.steps)
      mfu_chain.append(chain_flops / c / peak)
      if replay is not None:
        replay_state, r = timed(replay, replay_state, None, args.steps)
        mfu_replay.append(flops / r / peak)
    else:
      peak = table * peak_devices
    if i % 2:
      state_a, a = timed(ours, state_a, batch, args.steps)
      state_b, b = timed(theirs, state_b, batch, args.steps)
    else:
      state_b, b = timed(theirs, state_b, batch, args.steps)
      state_a, a = timed(ours, state_a, batch, args.steps)
    ratios.append(a / b)
    times_a.append(a)
    times_b.append(b)
    peaks_seen.append(peak)
    mfu_a.append(flops / a / peak)
    mfu_b.append(flops / b / peak)
    if default_peaks:
      mfu_default_peak.append(flops / a / default_peaks[-1])
  step_a, step_b = statistics.median(times_a), statistics.median(times_b)
  if table is not None:
    peak_text = f"{kind} dense {config.train.precision} peak {table / 1e12:.0f} TFLOP/s"
  else:
    peak_text = (
      f"peak {statistics.median(peaks_seen) / 1e9:.0f} GFLOP/s "
      f"({min(peaks_seen) / 1e9:.0f}-{max(peaks_seen) / 1e9:.0f} over the rounds)"
    )
  name = "lm_tiny at width 512" if args.model == "lm_tiny_512" else args.model
  model = f"{name} ({lm.param_count(model_config) / 1e6:.1f}M parameters)"
  if on_cpu:
    machine = common.machine(f"1 process x {DEVICES} CPU devices")
    dims, suffix = model, ""
  else:
    machine = common.machine(f"1 process x {devices} {kind}")
    dims = f"{model}, {config.train.precision}, batch {shape[0]} x {shape[1]} tokens"
    suffix = f"-{PLATFORM}"
  p1 = common.row(
    f"P1{suffix}",
    "trainer step ÷ hand-written `jax.jit` step (same model, shardings, optimizer)",
    statistics.median(ratios),
    1.02,
    True,
    f"{dims}: {step_a * 1e3:.1f} vs {step_b * 1e3:.1f} ms",
    machine,
  )
  if on_cpu:
    p3 = common.row(
      "P3",
      "trainer model FLOP/s ÷ float32 matmul peak measured in the same run",
      statistics.median(mfu_a),
      0.75,
      False,
      f"{model}, {peak_text}, the better of XLA's default and oneDNN's matmul "
      f"(default alone {statistics.median(default_peaks) / 1e9:.0f}; against it the step scores "
      f"{statistics.median(mfu_default_peak):.2f}); hand-written step "
      f"{statistics.median(mfu_b):.2f}; square matmuls alone {statistics.median(mfu_chain):.2f}"
      + (
        f"; the step's own matmuls alone {statistics.median(mfu_replay):.2f}" if mfu_replay else ""
      ),
      machine,
    )
  else:  # the issue sets no goal for the accelerator's MFU
    p3 = common.row(
      f"P3{suffix}",
      "trainer MFU (model FLOP/s ÷ the chip's dense peak)",
      statistics.median(mfu_a),
      None,
      False,
      f"{dims}: {tokens / step_a:,.0f} tokens/s against {peak_text}; hand-written step "
      f"MFU {statistics.median(mfu_b):.3f}, {tokens / step_b:,.0f} tokens/s",
      machine,
    )
  common.emit([p1, p3], args.json)


if __name__ == "__main__":
  main()
