"""E1: a multiple-choice eval's scored tokens/s over the train step's tokens/s, on this machine's device.

  python -m benchmarks.tpu_evals                                  # one TPU chip: E1 (goal >= 2)
  python -m benchmarks.tpu_evals --config=configs/llama_tiny.py --items=40 --train_steps=2 \\
      --calls=1                                                   # its smoke run, on a CPU

The config's model with random weights (the speed does not depend on them)
on the config's mesh over this machine's devices. The eval is `--items`
synthetic questions of `--choices` choices, a context of 100 to 300 token
ids and choices of 10 to 40 (HellaSwag's and ARC's sizes in a 32k
vocabulary), scored as `config.evals` scores a multiple-choice eval:
packed into rows of `seq_len` (`trainers.evals.packing`), `--rows` rows a
forward pass (default `global_batch`), each target's log-probability on the
mesh (`trainers.evals.loglikelihood.mesh_scorer`). Its rate counts each
choice's context and choice tokens once and leaves out the padding; the
best of `--calls` timed passes over the whole eval (the first compiles and
is not timed). The train step's rate is `benchmarks.tpu_check.on_device`'s
(`global_batch * seq_len` tokens a step). Prints one JSON line; `--out`
writes it too.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from benchmarks import common

GOAL = 2.0


def synthetic_pairs(items: int, choices: int, vocab: int, seed: int = 0):
  """`items * choices` (context + choice ids, the choice's count), contexts shared by an item's choices.

  Example:
    >>> pairs = synthetic_pairs(2, 3, 1000)
    >>> len(pairs), all(100 <= len(t) - k <= 300 and 10 <= k <= 40 for t, k in pairs)
    (6, True)
  """
  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(items):
    context = rng.integers(1, vocab, int(rng.integers(100, 301)))
    for _ in range(choices):
      choice = rng.integers(1, vocab, int(rng.integers(10, 41)))
      pairs.append((np.concatenate([context, choice]).astype(np.int32), len(choice)))
  return pairs


def measure_eval(config, items: int, choices: int, rows: int, calls: int) -> dict:
  """The eval's scored tokens/s on the config's mesh: best of `calls` passes after one to compile."""
  import jax

  from trainers.evals import loglikelihood, packing
  from trainers.step.eval_step import eval_inputs
  from trainers.step.mesh import build_mesh
  from trainers.step.state import make_state
  from trainers.tasks import make_task

  task = make_task(config)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes, task.optimizer)
  inputs = eval_inputs(setup.init())
  window = config.model.seq_len
  pairs = [
    (t[-(window + 1) :], k) for t, k in synthetic_pairs(items, choices, config.model.vocab_size)
  ]
  packed = packing.pack([t for t, _ in pairs], [k for _, k in pairs], window, rows)
  scorer = loglikelihood.mesh_scorer(setup, task, axes, rows)
  batches = packed.batches(rows)

  def one_pass() -> float:
    started = time.perf_counter()
    jax.block_until_ready([scorer(inputs, b) for b in batches])
    return time.perf_counter() - started

  compile_s = one_pass()
  best = min(one_pass() for _ in range(calls))
  scored = sum(len(t) for t, _ in pairs)  # context + choice tokens, each pair once
  return {
    "items": items,
    "choices": choices,
    "scored_tokens": scored,
    "rows": len(packed.inputs),
    "row_fill": round(packed.tokens / packed.inputs.size, 4),
    "first_pass_s": round(compile_s, 3),
    "pass_s": round(best, 4),
    "tokens_per_s": scored / best,
  }


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/llama_tpu_check.py")
  parser.add_argument("--items", type=int, default=1000)
  parser.add_argument("--choices", type=int, default=4)
  parser.add_argument("--rows", type=int, default=0, help="rows a forward pass (0: global_batch)")
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--train_steps", type=int, default=10)
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  import jax

  from benchmarks.common import load_config
  from benchmarks.tpu_check import on_device

  config = load_config(args.config)
  started = time.perf_counter()
  rows = args.rows or config.global_batch
  evals = measure_eval(config, args.items, args.choices, rows, args.calls)
  train = on_device(config, args.train_steps, warmup=2)
  value = evals["tokens_per_s"] / train["tokens_per_s"] if train.get("compiled") else math.nan
  result = {
    **common.chip_header("python3 -m benchmarks.tpu_evals", argv),
    "figure": "E1",
    "value": round(value, 3),
    "goal": GOAL,
    "config": args.config,
    "eval": {k: (round(v, 1) if isinstance(v, float) else v) for k, v in evals.items()},
    "train_tokens_per_s": round(train.get("tokens_per_s", math.nan), 1),
    "train_step_s": train.get("step_s"),
    "device": str(jax.devices()[0].device_kind),
    "seconds": round(time.perf_counter() - started, 1),
  }
  return common.emit_result(result, args.out)


if __name__ == "__main__":
  main()
