"""Tokens per second of sampling with the KV cache and without, for a config's model.

  python -m benchmarks.sample_speed [--config=configs/llama_tiny.py] [--tokens 48]
      [--prompt-len 2] [--calls 5]

One CPU device, batch 1, greedy, random weights (the speed does not depend
on them); each decoder is called once to compile, then timed over `--calls`
calls. Uncached is `decode.generate_uncached`: the whole forward pass over a
seq_len buffer for every token. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import jax


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/llama_tiny.py")
  parser.add_argument("--tokens", type=int, default=48)
  parser.add_argument("--prompt-len", type=int, default=2)
  parser.add_argument("--calls", type=int, default=5)
  args = parser.parse_args()
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", 1)
  import jax.numpy as jnp
  from flax import nnx

  from benchmarks.common import load_config, machine, seconds_per_call
  from trainers.models import decode
  from trainers.tasks import make_task

  model = make_task(load_config(args.config)).model(nnx.Rngs(0))
  prompt = jnp.arange(1, args.prompt_len + 1, dtype=jnp.int32)[None]
  out = {"config": args.config, "tokens": args.tokens, "prompt_len": args.prompt_len}
  runs = {
    "cached": lambda: decode.generate(model, prompt, args.tokens),
    "uncached": lambda: decode.generate_uncached(model, prompt, args.tokens),
  }
  results = {}
  for name, fn in runs.items():
    results[name] = jax.block_until_ready(fn())  # compile
    seconds = seconds_per_call(fn, args.calls)
    out[f"{name}_tokens_per_s"] = round(args.tokens / seconds, 1)
  out["same_tokens"] = bool((results["cached"] == results["uncached"]).all())
  out["speedup"] = round(out["cached_tokens_per_s"] / out["uncached_tokens_per_s"], 2)
  out["machine"] = machine("1 CPU device")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
