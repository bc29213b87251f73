"""Found: the branch guard and unstacked layers cost no more than their alternatives; the attention core costs more than its FLOPs.

  python -m benchmarks.investigations.step_variants [--variants=branch,select,stacked] [--rounds=30]
  # what the parts outside the weight matmuls cost
  python -m benchmarks.investigations.step_variants --variants=branch,no_attention_core,affine_norms,relu \\
      --rounds=16 --steps=3

One process, `BENCH_DEVICES` CPU devices (default 1), lm_tiny at width 512
(`benchmarks.trainer`'s model for the FLOP/s figure). Each variant is the
trainer's real step with one setting changed:
  branch   the default: a non-finite step keeps the old state through
           `lax.cond` (`train.nonfinite_guard="branch"`)
  select   `jnp.where(finite, new, old)` over every leaf instead, which makes
           XLA:CPU copy each donated optimizer moment first ("select")
  stacked  lm_tiny's former layout: its two blocks stacked and run as a fully
           unrolled scan, without remat (`model.scan_layers=True`)
Ablations, which take a part out of the model to show what it costs (not
models to train; they exist only while their step is traced):
  no_attention_core  each attention layer's scores, mask, softmax and weighted
           sum replaced by the values (`y = v + 0 * q * k`, which keeps the
           Q, K and V projections and their gradients in the step; with
           `0 * (q + k)` XLA would merge the Q and K projections into one
           matmul, and the ablation would take out more than the core)
  affine_norms  each layer norm replaced by its scale and bias alone
  relu     GELU replaced by ReLU
And one compiler setting: `onednn_dots`, the default step compiled with
`matmul_peak.ONEDNN_DOTS` (every dot one oneDNN call, not YNNPACK or Eigen).
Rounds of `--steps` steps, each step timed alone (it waits for its result),
the variants in turn and in reverse order every other round. Prints each
variant's min, 10th percentile and median step time, and the median of its
per-round ratios to the first variant, and the matmul FLOPs of its compiled
step (`spmd.hlo.matmul_flops`). On a shared machine one round's ratio
swings widely; the min and 10th percentile are what interference cannot
lower. The runs are in docs/engineering-log.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

# One device unless told: benchmarks.trainer (imported below for its model)
# sets up `BENCH_DEVICES` CPU devices, 4 by default.
os.environ.setdefault("BENCH_DEVICES", "1")

import jax

jax.config.update("jax_platforms", "cpu")

from benchmarks import common  # noqa: E402
from benchmarks.trainer import model_config_for  # noqa: E402
from spmd import hlo  # noqa: E402
from spmd.mesh import create_mesh  # noqa: E402
from trainers.models import transformer as lm  # noqa: E402
from trainers.models.layers import dense  # noqa: E402
from trainers.reporting import matmul_peak  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402


def _branch(config):
  config.train.nonfinite_guard = "branch"


def _select(config):
  config.train.nonfinite_guard = "select"


def _stacked(config):
  config.model.scan_layers = True
  config.model.scan_unroll = config.model.num_layers
  config.model.remat_policy = "none"


@contextlib.contextmanager
def _replaced(owner, name: str, value):
  """`owner.name` is `value` inside the block (while a variant's step is traced)."""
  old = getattr(owner, name)
  setattr(owner, name, value)
  try:
    yield
  finally:
    setattr(owner, name, old)


def _attention_without_core(self, x, mask=None):
  del mask  # no scores to mask
  dt = x.dtype
  q, k, v = (dense(x, w[...].astype(dt)) for w in (self.query, self.key, self.value))
  return dense(v + 0 * q * k, self.out[...].astype(dt), contract=2)


def _no_attention_core(config):
  return _replaced(lm._Attention, "__call__", _attention_without_core)


def _affine_norms(config):
  return _replaced(lm._LayerNorm, "__call__", lambda self, x: x * self.scale[...] + self.bias[...])


def _relu(config):
  return _replaced(jax.nn, "gelu", lambda x, approximate=True: jax.nn.relu(x))


# Each variant changes the config and may return a context in which its step
# is built and traced (the ablations); the others return None.
VARIANTS = {
  "branch": _branch,
  "select": _select,
  "stacked": _stacked,
  "no_attention_core": _no_attention_core,
  "affine_norms": _affine_norms,
  "relu": _relu,
  "onednn_dots": _branch,  # the default step, compiled with COMPILER_OPTIONS below
}
# XLA options a variant's step is compiled with (the others: XLA's defaults).
COMPILER_OPTIONS = {"onednn_dots": matmul_peak.ONEDNN_DOTS}


def _one_round(run: dict, steps: int) -> list[float]:
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    run["state"], metrics = run["step"](run["state"], run["batch"])
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variants", default="branch,select,stacked")
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--steps", type=int, default=2, help="steps per round and variant")
  parser.add_argument("--global-batch", type=int)
  parser.add_argument("--seq-len", type=int)
  parser.add_argument("--num-layers", type=int)
  args = parser.parse_args()
  names = args.variants.split(",")
  if unknown := [n for n in names if n not in VARIANTS]:
    parser.error(f"variants {unknown} are not among {sorted(VARIANTS)}")
  mesh = create_mesh("data=-1")
  runs = []
  for name in names:
    config = model_config_for(
      argparse.Namespace(
        model="lm_tiny_512",
        **{k: getattr(args, k) for k in ("global_batch", "seq_len", "num_layers")},
      )
    )
    with VARIANTS[name](config) or contextlib.nullcontext():
      setup, _, batch = common.transformer_setup(config, mesh)
      run = {
        "step": make_train_step(setup, make_task(config), config, mesh, ("data",)),
        "state": setup.init(),
        "batch": batch,
        "times": [],
        "means": [],
      }
      _one_round(run, 2)  # traced (so an ablation takes effect), compiled, warmed up
      # What the variant's compiled program multiplies: shows an ablation took effect.
      compiled = run["step"].lower(run["state"], batch).compile(COMPILER_OPTIONS.get(name))
      run["matmul_flops"] = hlo.matmul_flops(compiled.as_text())
      if name in COMPILER_OPTIONS:
        run["step"] = compiled  # called as the jitted step is, state donated
        _one_round(run, 1)
    runs.append(run)
  for r in range(args.rounds):
    for run in runs if r % 2 == 0 else runs[::-1]:
      times = _one_round(run, args.steps)
      run["times"] += times
      run["means"].append(statistics.mean(times))
  devices = mesh.devices.size
  print(f"lm_tiny at width 512, {devices} CPU device(s), {args.rounds} rounds of {args.steps}")
  print("| variant | min ms | p10 ms | median ms | ÷ first (median of rounds) | matmul GFLOP |")
  print("|---|---|---|---|---|---|")
  for name, run in zip(names, runs):
    times = sorted(run["times"])
    ratio = statistics.median(a / b for a, b in zip(run["means"], runs[0]["means"]))
    p10 = times[len(times) // 10]
    print(
      f"| {name} | {times[0] * 1e3:.1f} | {p10 * 1e3:.1f} | "
      f"{statistics.median(times) * 1e3:.1f} | {ratio:.3f} | {run['matmul_flops'] / 1e9:.4f} |"
    )


if __name__ == "__main__":
  main()
