"""Found: at batch 32 a decode step spent 1.05 of its 2.37 ms in attention; a Pallas kernel takes it to 1.89 ms.

  python -m benchmarks.investigations.decode_attention                 # on one TPU chip
  python -m benchmarks.investigations.decode_attention --variants=kernel,xla --batches=32,16,1 \\
      --profile=kernel                                                 # and where a step's time goes
  SMALL=1 python -m benchmarks.investigations.decode_attention --batches=16  # its smoke run, on a CPU

The check model (`configs/llama_tpu_check.py`'s sizes, random weights in
bf16), `generate_batch` of `--batches` prompts of 64 tokens by 256, timed as
`benchmarks.tpu_sample` times it (S = its bound / the step). Variants:
  kernel  the code as it is: one query a row on a TPU at >= 16 rows runs
          `trainers.models.decode_attention`'s kernel
  xla     XLA's einsums always (the kernel's routing turned off)
  noattn  attention left out of the decode steps (y = q): what the rest costs
With `--profile`, one more call of each named variant at the first batch is
traced, and the device time of each HLO op a step is printed. XLA's
`cost_analysis()` counts a while loop's body once, so the profile, not the
compiled bytes, says where a step's time goes. The runs are in the issue's report.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import tpu_sample
from trainers.models import decode, decode_batch, llama

_routing = decode._use_kernel


def _model(small: bool) -> llama.Llama:
  if small:
    config = llama.LlamaConfig(
      vocab_size=512, seq_len=64, num_layers=2, d_model=512, num_heads=4, num_kv_heads=2,
      d_ff=128, dtype="bfloat16",
    )  # fmt: skip
  else:
    config = llama.LlamaConfig(
      vocab_size=32000, seq_len=2048, num_layers=16, d_model=1536, num_heads=12,
      num_kv_heads=4, d_ff=4096, rope_theta=500000.0, dtype="bfloat16",
    )  # fmt: skip
  model = llama.Llama(config, rngs=nnx.Rngs(0))
  bf16 = jax.jit(lambda s: jax.tree.map(lambda x: x.astype(jnp.bfloat16), s))
  nnx.update(model, bf16(nnx.state(model, nnx.Param)))
  return model


def _use(variant: str) -> None:
  jax.clear_caches()  # the programs are traced again with the variant's functions
  decode._use_kernel = (lambda *a: False) if variant in ("xla", "noattn") else _routing
  decode._attend = _no_attention if variant == "noattn" else _attend


_attend = decode._attend


def _no_attention(q, cache, layer, index, starts):
  return _attend(q, cache, layer, index, starts) if q.shape[1] != 1 else q


def _prompts(model, batch: int, prompt_len: int) -> list[list[int]]:
  vocab = model.config.vocab_size
  return [[(row * 7 + t) % vocab for t in range(prompt_len)] for row in range(batch)]


def _profile(model, prompts, tokens: int) -> None:
  folder = tempfile.mkdtemp(prefix="decode-trace-")
  decode_batch.generate_batch(model, prompts, tokens)
  jax.profiler.start_trace(folder)
  out = decode_batch.generate_batch(model, prompts, tokens)
  jax.profiler.stop_trace()
  path = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0]
  spent, count = collections.Counter(), collections.Counter()
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if plane.name.startswith("/device:TPU:0"):
      for line in plane.lines:
        if line.name == "XLA Ops":
          for event in line.events:
            spent[event.name] += event.duration_ns
            count[event.name] += 1
  shutil.rmtree(folder, ignore_errors=True)
  for name, ns in spent.most_common(20):
    print(f"  {ns / out.steps / 1e3:9.2f} us a step  x{count[name] / out.steps:5.1f}  {name[:150]}")


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variants", default="kernel,xla")
  parser.add_argument("--batches", default="32,1")
  parser.add_argument("--profile", default="")
  args = parser.parse_args(argv)
  small = os.environ.get("SMALL") == "1"
  prompt_len, tokens = (8, 12) if small else (64, 256)
  model = _model(small)
  batches = [int(b) for b in args.batches.split(",")]
  for batch in batches:
    prompts = _prompts(model, batch, prompt_len)
    for variant in args.variants.split(","):
      _use(variant)
      best = math.inf
      for _ in range(1 if small else 3):
        out = decode_batch.generate_batch(model, prompts, tokens)
        best = min(best, out.decode_seconds / out.steps)
      bound = sum(tpu_sample.step_bytes(model, batch, prompt_len, tokens).values()) / 819e9
      row = {"variant": variant, "batch": batch, "step_ms": round(best * 1e3, 4)}
      print(json.dumps({**row, "bound_ms": round(bound * 1e3, 4), "S": round(bound / best, 3)}))
  for variant in filter(None, args.profile.split(",")):
    _use(variant)
    print(f"== {variant} at batch {batches[0]}: device time of each op, a step")
    _profile(model, _prompts(model, batches[0], prompt_len), tokens)
  _use("kernel")


if __name__ == "__main__":
  main()
