"""Found: of our step's extras only the accuracy costs the chip anything (0.5 %); P11's 5 % was the MLP's 3-D form.

  python -m benchmarks.investigations.p11_extras [--rows=2] [--rounds=8] [--steps=3] [--trace_steps=2]   # on the chip
  python -m benchmarks.investigations.p11_extras --tiny --rows=2 --rounds=1 --steps=1 --trace_steps=0   # on a CPU

P11 (`benchmarks/tpu_llama.py`) times our step against a hand-written one
that does less: it differentiates the mean loss and returns only the loss.
Ours differentiates the summed loss and divides the gradients by the token
count, reports the gradient norm and the accuracy, keeps the old state when
the loss or the norm is not finite (a select on a TPU) and counts steps,
applied updates and bad steps. Here the hand-written step gains those
extras one at a time, and all together:
  hand      `tpu_llama.hand_written_step`'s work
  +sum      the summed loss differentiated, the gradients divided by the count after
  +norm     `optax.tree.norm(grads)` returned as a metric
  +guard    the non-finite guard: `jnp.where(finite, new, old)` over params and moments
  +accuracy the chunked loss's correct-token sum, divided by the count
  +counters step, updates and bad_steps in the state
  all       every extra above: the work our step does, in plain JAX
  ours      the trainer's step (`make_train_step`)
  ours_3d_mlp  ours with the MLP's former form, its gate and up outputs reshaped
            to [rows, length, d_ff] between the matmuls (`layers.dense`)
  ours_unconstrained  ours without the model's activation constraints (on one
            chip they pin nothing)
Both exist only while their step is traced.
`--variants` picks some of these by name.
All share one batch of the check's 501M Llama (`configs/llama_tpu_check.py`);
the hand-written variants share one state, ours has its own (the chip holds
two). Rounds of `--steps` steps, the variants in turn and in reverse order
every other round; each variant's median step time and its median per-round
ratio to `hand`. With `--trace_steps`, the top ops of `hand`, `all` and
`ours` by device time (`tpu_tuning.profile`). Writes `$OUT/p11_extras.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import tpu_check, tpu_llama, tpu_tuning  # noqa: E402
from spmd.layout import batch_sharding  # noqa: E402
from trainers.models import llama  # noqa: E402
from trainers.models.layers import dense  # noqa: E402
from trainers.step.mesh import build_mesh  # noqa: E402
from trainers.step.state import make_state  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402

EXTRAS = ("sum", "norm", "guard", "accuracy", "counters")


def hand_variant(config, extras: frozenset[str]):
  """The hand-written step with `extras` (a subset of `EXTRAS`) added; jitted, state donated."""
  unknown = set(extras) - set(EXTRAS)
  if unknown:
    raise ValueError(f"{sorted(unknown)} are not among {EXTRAS}")
  loss_sums, tx = tpu_llama.hand_loss(config), tpu_llama.hand_optimizer(config)

  def objective(params, batch):
    loss_sum, weight, correct = loss_sums(params, batch)
    if "sum" in extras:
      return loss_sum, (weight, correct)
    return loss_sum / weight, (weight, correct)

  def step(state, batch):
    params, opt_state = state["params"], state["opt_state"]
    (loss, (weight, correct)), grads = jax.value_and_grad(objective, has_aux=True)(params, batch)
    count = jnp.maximum(weight, 1e-9)
    if "sum" in extras:
      grads = jax.tree.map(lambda g: g / count, grads)
      loss = loss / count
    metrics = {"loss": loss}
    grad_norm = optax.tree.norm(grads) if {"norm", "guard"} & extras else None
    if "norm" in extras:
      metrics["grad_norm"] = grad_norm
    updates, new_opt = tx.update(grads, opt_state, params)
    new = dict(state, params=optax.apply_updates(params, updates), opt_state=new_opt)
    finite = jnp.array(True)
    if "guard" in extras:
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      new["params"], new["opt_state"] = jax.tree.map(
        lambda n, o: jnp.where(finite, n, o),
        (new["params"], new["opt_state"]),
        (params, opt_state),
      )
      metrics["finite"] = finite
    if "accuracy" in extras:
      metrics["accuracy"] = correct / count
    if "counters" in extras:
      new["step"] = state["step"] + 1
      new["updates"] = state["updates"] + finite.astype(jnp.int32)
      new["bad_steps"] = jnp.where(finite, 0, state["bad_steps"] + 1).astype(jnp.int32)
      metrics["bad_steps"] = new["bad_steps"]
    return new, metrics

  return jax.jit(step, donate_argnums=0), tx


def variants() -> dict[str, frozenset[str]]:
  """Each hand-written variant's extras, by name."""
  out = {"hand": frozenset()}
  out.update({f"+{e}": frozenset({e}) for e in EXTRAS})
  out["all"] = frozenset(EXTRAS)
  return out


OURS = ("ours", "ours_3d_mlp", "ours_unconstrained")


def _mlp_3d(self, x):
  """`llama.MLP.__call__` as it was: each matmul's output reshaped to [rows, length, features]."""
  dt = x.dtype
  names = ("batch", "length", "mlp")
  gate = llama.constrain(dense(x, self.gate[...].astype(dt)), names)
  up = llama.constrain(dense(x, self.up[...].astype(dt)), names)
  return dense(jax.nn.silu(gate) * up, self.down[...].astype(dt))


@contextlib.contextmanager
def _ablation(name: str):
  """The model changed as the variant `name` says, while its step is traced."""
  mlp, constrain = llama.MLP.__call__, llama.constrain
  if name == "ours_3d_mlp":
    llama.MLP.__call__ = _mlp_3d
  if name == "ours_unconstrained":
    llama.constrain = lambda x, logical: x
  try:
    yield
  finally:
    llama.MLP.__call__, llama.constrain = mlp, constrain


def measure(config, rounds: int, steps: int, trace_steps: int, names: list[str]) -> dict:
  """The named variants on one batch: step times, ratios to `hand`, and profiles."""
  task = make_task(config)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes, task.optimizer)
  rows, length = config.global_batch, config.model.seq_len
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (rows, length + 1))
  spec = batch_sharding(mesh, axes)
  batch = {
    "inputs": jax.device_put(tokens[:, :-1].astype(np.int32), spec),
    "targets": jax.device_put(tokens[:, 1:].astype(np.int32), spec),
    "mask": jax.device_put(np.ones((rows, length), np.float32), spec),
  }
  ours_state = setup.init()
  params = tpu_llama.hand_params(ours_state["params"])
  steps_by_name, tx = {}, None
  for name, extras in variants().items():
    if name in names or tx is None:
      steps_by_name[name], tx = hand_variant(config, extras)
  counters = {name: jnp.zeros((), jnp.int32) for name in ("step", "updates", "bad_steps")}
  states = {
    "hand": {"params": params, "opt_state": tx.init(params), **counters},
    "ours": ours_state,
  }
  for name in OURS:
    if name in names:
      steps_by_name[name] = make_train_step(setup, task, config, mesh, axes)
  compiled, compile_s = {}, {}
  for name, step in steps_by_name.items():
    kind = "ours" if name in OURS else "hand"
    started = time.perf_counter()
    with _ablation(name):
      compiled[name] = step.lower(states[kind], batch).compile()
    compile_s[name] = time.perf_counter() - started
    print(f"{name}: compiled in {compile_s[name]:.1f} s", flush=True)

  def run(name: str, n: int) -> tuple[float, dict]:
    kind = "ours" if name in OURS else "hand"
    started = time.perf_counter()
    for _ in range(n):
      states[kind], metrics = compiled[name](states[kind], batch)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - started) / n, metrics

  # Each state's first step (its learning rate is 0 at the warmup's start).
  first_loss = {
    name: float(run(name, 1)[1]["loss"]) for name in ("hand", "ours") if name in compiled
  }
  for name in compiled:
    run(name, 1)
  names = list(compiled)
  times: dict[str, list[float]] = {n: [] for n in names}
  for i in range(rounds):
    for name in names if i % 2 == 0 else names[::-1]:
      times[name].append(run(name, steps)[0])
  out = {
    "rows": rows,
    "rounds": rounds,
    "steps": steps,
    "first_loss": first_loss,
    "compile_s": compile_s,
    "step_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
    "ratio_to_hand": {
      n: statistics.median(a / b for a, b in zip(t, times["hand"])) for n, t in times.items()
    },
  }
  if trace_steps:
    out["profiles"] = {}
    for name in ("hand", "all", "ours"):
      if name not in compiled:
        continue
      kind = "ours" if name in OURS else "hand"
      out["profiles"][name], states[kind] = tpu_tuning.profile(
        compiled[name], states[kind], batch, trace_steps, compiled[name].as_text(), top=40
      )
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--trace_steps", type=int, default=2)
  parser.add_argument("--tuning", default="", help="a setting for `tpu_tuning.apply`")
  parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (its test)")
  parser.add_argument(
    "--variants", default=",".join([*variants(), *OURS]), help="comma-separated names"
  )
  parser.add_argument("--out", default=os.environ.get("OUT", ".") + "/p11_extras.json")
  args = parser.parse_args(argv)
  setting = json.loads(Path(args.tuning).read_text()) if args.tuning else {}
  tpu_tuning.apply(setting)
  config = tpu_tuning.configure(tpu_check.check_config(args.rows, args.tiny), setting)
  config.global_batch = args.rows
  names = args.variants.split(",")
  unknown = set(names) - {*variants(), *OURS}
  if unknown or "hand" not in names:
    parser.error(
      f"--variants={args.variants!r}: 'hand' is needed, and {sorted(unknown)} are unknown"
    )
  result = measure(config, args.rounds, args.steps, args.trace_steps, names)
  result.update(device_kind=jax.local_devices()[0].device_kind, setting=setting)
  Path(args.out).write_text(json.dumps(result, indent=1, default=str))
  print(f"{'variant':>10}  {'step ms':>8}  {'/ hand':>7}")
  for name, ms in result["step_ms"].items():
    print(f"{name:>10}  {ms:8.2f}  {result['ratio_to_hand'][name]:7.4f}")
  print(f"first losses: {result['first_loss']}; written to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
