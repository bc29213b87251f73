"""S1/S2: batched decoding's speed against the bytes a step must read, on this machine's device.

  python -m benchmarks.tpu_sample                                     # one TPU chip: S1, S2
  python -m benchmarks.tpu_sample --config=configs/llama_tiny.py --prompt_len=4 --tokens=8 \\
      --batches=1,2                                                   # its smoke run, on a CPU

The config's model with random weights (the speed does not depend on them),
its parameters in the compute dtype (`config.train.precision`), on one
device; `trainers.models.decode_batch.generate_batch`, what `spmd-sample`
runs, continues `batch` prompts of `--prompt_len` tokens by `--tokens`
tokens, greedy, with a cache of prompt + new tokens. The decode loop alone
is timed (no compile, no prefill), the best of `--calls` calls. A step's
bound is the bytes it must read / `--hbm_gbps`: every parameter but the
embedding table (its `batch` gathered rows instead), plus the keys and
values of the live positions (prompt + the step's index, averaged over the
steps). S = bound / measured step time: S1 at batch 1 (goal >= 0.8), S2 at
batch 32 (goal >= 0.6). Prints one JSON line; `--out` writes it too.
"""

from __future__ import annotations

import argparse
import math
import time

from benchmarks import common

V5E_HBM_GBPS = 819.0
GOALS = {1: ("S1", 0.8), 32: ("S2", 0.6)}


def step_bytes(model, batch: int, prompt_len: int, tokens: int) -> dict[str, float]:
  """What one decode step must read, in bytes: weights, gathered embedding rows, live cache.

  Example:
    >>> from flax import nnx
    >>> from trainers.models import llama
    >>> config = llama.LlamaConfig(vocab_size=64, seq_len=16, num_layers=1, d_model=8,
    ...                            num_heads=2, num_kv_heads=1, d_ff=16)
    >>> got = step_bytes(llama.Llama(config, rngs=nnx.Rngs(0)), 2, 4, 3)
    >>> # 2 rows of 8 float32; k, v: 1 layer x 2 rows x 1 head x 4 x 4 B = 64 B a position,
    >>> # positions 5 and 6 live in steps 1 and 2
    >>> got["embedding_rows"], got["cache"]
    (64, 352.0)
  """
  import jax
  from flax import nnx

  from trainers.models import decode

  params = nnx.state(model, nnx.Param)
  table = model.token_embed[...]
  tied = getattr(model.config, "tie_embeddings", False)
  weights = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
  if not tied:  # a tied table is read whole as the unembedding
    weights -= table.nbytes
  rows = batch * table.shape[1] * table.dtype.itemsize
  shape = decode.cache_shape(model.config)
  # A step i (1..tokens-1) reads the keys and values of prompt_len + i positions.
  live = sum(prompt_len + i for i in range(1, tokens)) / max(tokens - 1, 1)
  per_position = shape.bytes(batch, 1)
  return {"weights": weights, "embedding_rows": rows, "cache": per_position * live}


def measure(model, batch: int, prompt_len: int, tokens: int, calls: int, hbm_gbps: float) -> dict:
  """One batch size's decode: seconds a step (best of `calls`), its bound and their ratio."""
  from trainers.models import decode_batch

  vocab = model.config.vocab_size
  prompts = [[(row * 7 + t) % vocab for t in range(prompt_len)] for row in range(batch)]
  best = math.inf
  for _ in range(calls):
    out = decode_batch.generate_batch(model, prompts, tokens)
    best = min(best, out.decode_seconds / out.steps)
  read = step_bytes(model, batch, prompt_len, tokens)
  bound = sum(read.values()) / (hbm_gbps * 1e9)
  name, goal = GOALS.get(batch, (f"S@{batch}", None))
  return {
    "figure": name,
    "batch": batch,
    "step_ms": round(best * 1e3, 4),
    "bound_ms": round(bound * 1e3, 4),
    "value": round(bound / best, 4),
    "goal": goal,
    "tokens_per_s": round(batch / best, 1),
    "bytes_a_step": {k: int(v) for k, v in read.items()},
    "platform": out.platform,
  }


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/llama_tpu_check.py")
  parser.add_argument("--batches", default="1,32")
  parser.add_argument("--prompt_len", type=int, default=64)
  parser.add_argument("--tokens", type=int, default=256)
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--hbm_gbps", type=float, default=V5E_HBM_GBPS)
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  import jax
  from flax import nnx

  from benchmarks.common import load_config
  from trainers.step.precision import Precision
  from trainers.tasks import make_task

  config = load_config(args.config)
  started = time.perf_counter()
  model = make_task(config).model(nnx.Rngs(0))  # on the default device
  policy = Precision(config.train.get("precision", "float32"))
  nnx.update(model, jax.jit(policy.cast_params)(nnx.state(model, nnx.Param)))
  rows = [
    measure(model, int(b), args.prompt_len, args.tokens, args.calls, args.hbm_gbps)
    for b in args.batches.split(",")
  ]
  result = {
    **common.chip_header("python3 -m benchmarks.tpu_sample", argv),
    "config": args.config,
    "prompt_len": args.prompt_len,
    "tokens": args.tokens,
    "hbm_gbps": args.hbm_gbps,
    "device": str(jax.devices()[0].device_kind),
    "rows": rows,
    "seconds": round(time.perf_counter() - started, 1),
  }
  return common.emit_result(result, args.out)


if __name__ == "__main__":
  main()
