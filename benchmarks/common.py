"""What every benchmark shares: side-by-side timing, the machine's description, results.

Each benchmark script measures one or more figures of the performance table
(P1-P8, see `benchmarks/run.py`) and writes them as a JSON list of rows:

  {"id": "P4", "what": "...", "value": 1.01, "goal": "<= 1.03", "meets_goal": true,
   "detail": "...", "machine": "...", "date": "2026-11-30"}

Timings are ratios measured in one run, each round timing both sides back
to back in alternating order, so the machine's noise hits both alike.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable


def machine(devices: str) -> str:
  """One line: the CPU, its cores, the JAX devices, the JAX version and the allocator."""
  import jax

  from launch import allocator

  malloc = "TCMalloc" if allocator.is_preloaded() else "glibc malloc"
  return f"{platform.machine()}, {os.cpu_count()} cores, {devices}, jax {jax.__version__}, {malloc}"


def load_config(path: str):
  """The ml_collections config in file `path`, as `--config=path` would load it."""
  from absl import flags
  from ml_collections import config_flags

  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv)
  # Given explicitly: with no --config in its argv, config_flags looks for one
  # in sys.argv, where the benchmark's own --config may be.
  fv(["benchmark", f"--config={path}"])
  return fv.config


def transformer_setup(config, mesh, batch_axes: tuple[str, ...] = ("data",)):
  """(train state setup, model config, a placed random batch) for the transformer in `config`.

  The batch is one random token stream cut into inputs and the next tokens
  as targets, all positions counted: what the language-model task feeds,
  without reading data. The benchmarks that time the step of a config
  (P1, P3, `investigations.profile_step`, `investigations.step_variants`)
  build their state here.

  Example:
    >>> from configs import lm_tiny_bytes
    >>> from spmd.mesh import create_mesh
    >>> config = lm_tiny_bytes.get_config()
    >>> config.global_batch, config.model.seq_len = 8, 16
    >>> setup, model_config, batch = transformer_setup(config, create_mesh("data=-1"))
    >>> batch["inputs"].shape, model_config.d_model
    ((8, 16), 128)
  """
  import jax
  import numpy as np

  from spmd.layout import batch_sharding
  from trainers.models import transformer as lm
  from trainers.step.state import make_state
  from trainers.tasks.lm import transformer_config

  model_config = transformer_config(config)
  setup = make_state(lambda rngs: lm.TransformerLM(model_config, rngs=rngs), config, mesh)
  spec = batch_sharding(mesh, batch_axes)
  batch_size, length = config.global_batch, config.model.seq_len
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, model_config.vocab_size, (batch_size, length + 1), np.int32)
  batch = {
    "inputs": jax.device_put(tokens[:, :-1], spec),
    "targets": jax.device_put(tokens[:, 1:], spec),
    "mask": jax.device_put(np.ones((batch_size, length), np.float32), spec),
  }
  return setup, model_config, batch


def alternate(
  ours: Callable[[], float], theirs: Callable[[], float], rounds: int
) -> tuple[float, float, float]:
  """(median ratio ours/theirs, median ours, median theirs) over alternating rounds.

  Each callable runs one round and returns its seconds per unit of work.

  Example:
    >>> ratio, a, b = alternate(lambda: 2.0, lambda: 1.0, rounds=3)
    >>> ratio, a, b
    (2.0, 2.0, 1.0)
  """
  ratios, a_times, b_times = [], [], []
  for i in range(rounds):
    if i % 2:
      a, b = ours(), theirs()
    else:
      b, a = theirs(), ours()
    ratios.append(a / b)
    a_times.append(a)
    b_times.append(b)
  return statistics.median(ratios), statistics.median(a_times), statistics.median(b_times)


def covered(intervals: list[tuple[float, float]]) -> float:
  """How much time the (start, end) intervals cover together: overlaps count once.

  A trace's ops can run at once (XLA:CPU runs independent ops side by side),
  so the sum of their durations can exceed the time they took.

  Example:
    >>> covered([(0, 2), (1, 3), (5, 6)])
    4
    >>> covered([])
    0
  """
  total, end = 0, None
  for s, e in sorted(intervals):
    if end is None or s > end:
      total, end = total + e - s, e
    elif e > end:
      total, end = total + e - end, e
  return total


def square_matmul_step(flops: float, size: int = 2048):
  """(a step of square matmuls of about `flops` in all, its first state, its FLOPs).

  The step has a train step's signature, `(state, batch) -> (state, metrics)`,
  so the loop that times a train step times it too: its output feeds the
  next call, as a train step's state does. Each matmul multiplies by one orthogonal matrix, which keeps
  every value finite however many steps run (squaring the state instead
  overflowed to inf within two steps).

  Example:
    >>> import jax.numpy as jnp
    >>> step, state, flops = square_matmul_step(3 * 2 * 64**3, size=64)
    >>> for _ in range(50):  # 150 matmuls
    ...   state, _ = step(state, None)
    >>> flops, bool(jnp.isfinite(state).all())
    (1572864.0, True)
  """
  import jax
  import jax.numpy as jnp

  links = max(1, round(flops / (2 * size**3)))
  kq, kx = jax.random.split(jax.random.key(1))
  q, _ = jnp.linalg.qr(jax.random.normal(kq, (size, size), jnp.float32))

  @jax.jit
  def step(y, _batch):
    for _ in range(links):
      y = y @ q
    return y, y

  return step, jax.random.normal(kx, (size, size), jnp.float32), links * 2.0 * size**3


def dots_alone_step(dots):
  """(a step of just these dots, its first state, its FLOPs): what a step's matmuls cost alone.

  `dots` are a compiled step's (`spmd.hlo.dots`): the same shapes, dimension
  numbers and count, each on operands of its own, with nothing else of the
  step (no elementwise work, no optimizer, no data dependencies between
  them, so XLA may run any of them side by side). Timed like the step, it
  bounds what the step could score if everything but its matmuls were free.
  Same signature as a train step, `(state, batch) -> (state, metrics)`.

  Example:
    >>> from spmd import hlo
    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b.T)
    >>> a = b = jnp.ones((8, 8))
    >>> text = f.lower(a, b).compile().as_text()
    >>> step, state, flops = dots_alone_step(hlo.dots(text))
    >>> state, outs = step(state, None)
    >>> len(outs), flops == hlo.matmul_flops(text)
    (2, True)
  """
  import jax

  dots = [d for d in dots for _ in range(d.count)]
  keys = iter(jax.random.split(jax.random.key(2), 2 * len(dots)))
  operands = tuple(
    (jax.random.normal(next(keys), d.lhs, d.dtype), jax.random.normal(next(keys), d.rhs, d.dtype))
    for d in dots
  )

  def step(state, _batch):
    outs = [
      jax.lax.dot_general(lhs, rhs, d.dimension_numbers) for d, (lhs, rhs) in zip(dots, state)
    ]
    return state, outs

  # Donated and returned unchanged: the operands are aliased, not copied.
  return jax.jit(step, donate_argnums=0), operands, float(sum(d.flops for d in dots))


def seconds_per_call(fn: Callable[[], object], calls: int) -> float:
  """Seconds per call of `fn` over `calls` calls, waiting for the last result."""
  import jax

  out = None
  start = time.perf_counter()
  for _ in range(calls):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def row(
  figure: str,
  what: str,
  value: float,
  goal: float | None,
  at_most: bool,
  detail: str,
  machine_text: str,
) -> dict:
  """One figure of the table; `at_most` says whether the goal is a ceiling or a floor.

  A figure reported without a goal (`goal=None`) has `meets_goal` None.

  Example:
    >>> row("P9", "x", 1.0, 1.1, True, "", "m")["meets_goal"], row("P9", "x", 1.0, None, True, "", "m")["goal"]
    (True, '—')
  """
  return {
    "id": figure,
    "what": what,
    "value": round(value, 4),
    "goal": "—" if goal is None else f"{'≤' if at_most else '≥'} {goal}",
    "meets_goal": None if goal is None else value <= goal if at_most else value >= goal,
    "detail": detail,
    "machine": machine_text,
    "date": datetime.date.today().isoformat(),
  }


def emit(rows: list[dict], json_path: str | None) -> None:
  """Prints the rows as a Markdown table and writes them to `json_path` if given."""
  print(markdown(rows), end="")
  if json_path:
    with open(json_path, "w") as f:
      json.dump(rows, f, indent=1)
      f.write("\n")


def chip_header(command: str, argv: list[str] | None) -> dict:
  """What a chip run's JSON starts with: jax, the device, the date and the command as typed.

  `benchmarks.run --from-tpu-check` names the machine and the command from it.

  Example:
    >>> sorted(chip_header("python3 -m benchmarks.tpu_sample", ["--batches=1"]))
    ['command', 'date', 'device_kind', 'jax']
  """
  import jax

  return {
    "jax": jax.__version__,
    "device_kind": jax.local_devices()[0].device_kind,
    "date": time.strftime("%Y-%m-%d"),
    "command": " ".join([command, *(argv if argv is not None else sys.argv[1:])]),
  }


def emit_result(result: dict, out: str | None) -> dict:
  """Prints a chip run's `result` as one JSON line and writes that line to `out` if given.

  Example:
    >>> emit_result({"figure": "S1", "value": 0.8}, None)
    {"figure": "S1", "value": 0.8}
    {'figure': 'S1', 'value': 0.8}
  """
  line = json.dumps(result)
  print(line, flush=True)
  if out:
    with open(out, "w") as f:
      f.write(line + "\n")
  return result


def markdown(rows: list[dict]) -> str:
  """The rows as the README's performance table."""
  lines = [
    "| id | figure | result | goal | met | detail |",
    "|---|---|---|---|---|---|",
  ]
  for r in rows:
    met = {True: "yes", False: "**no**", None: "—"}[r["meets_goal"]]
    # No value: the figure could not be measured (e.g. the compiler refused), its detail says why.
    value = "none" if r["value"] is None else f"{r['value']:.3f}"
    lines.append(f"| {r['id']} | {r['what']} | {value} | {r['goal']} | {met} | {r['detail']} |")
  return "\n".join(lines) + "\n"
