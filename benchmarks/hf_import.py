"""I1: host memory of a Hugging Face import: one process's peak RSS rise ÷ the model's f32 bytes.

  python -m benchmarks.hf_import [--layers=18] [--processes=4] [--json=out.json]
  # its test: one layer and a smaller vocabulary, to show the script runs
  python -m benchmarks.hf_import --layers=1 --vocab-size=4096 --processes=2

Writes a random bf16 safetensors folder of a Llama shape (d_model 2048, 16
heads sharing 8 key/value heads, SwiGLU 5632, vocabulary 32000, untied: about
1.0B parameters at 18 layers), one shard per layer with its index, then
imports it on N processes x 1 CPU device with FSDP over all N, through
`configs/hf.py` and `trainers.hf.checkpoint.read_params`, the code
`spmd-train` runs. Each process reports the rise of its peak RSS across the
import; the figure is the largest rise ÷ the model's parameter bytes in f32.
A process's own share is 1/N (its device's arrays live in host memory on
CPU); goal: at most 0.4 at N=4, i.e. the reading costs at most 0.15 of the
model on top of the share, never the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(
  vocab_size=32000,
  hidden_size=2048,
  intermediate_size=5632,
  num_attention_heads=16,
  num_key_value_heads=8,
)
RESULT = "hf_import_result:"


def write_folder(
  folder: str,
  layers: int,
  seed: int = 0,
  vocab_size: int | None = None,
  shape: dict | None = None,
  max_position_embeddings: int = 2048,
) -> int:
  """A random bf16 Llama folder with `layers` layers, one shard per layer; its parameter count.

  `vocab_size` replaces `SHAPE`'s (the embedding and output tables are most
  of a one-layer folder: a test shrinks them); `shape` replaces `SHAPE`
  whole (config.json's fields, `head_dim` among them when it is not
  hidden_size / heads: `benchmarks.tpu_lora`'s family).
  """
  import ml_dtypes

  from trainers.hf.safetensors_files import write_file

  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(seed)
  shape = dict(shape or SHAPE)
  shape["vocab_size"] = vocab_size or shape["vocab_size"]
  d, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
  head_dim = shape.get("head_dim", d // shape["num_attention_heads"])
  q = shape["num_attention_heads"] * head_dim
  kv = shape["num_key_value_heads"] * head_dim

  def random(*shape):
    return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

  shapes = {
    "self_attn.q_proj.weight": (q, d),
    "self_attn.k_proj.weight": (kv, d),
    "self_attn.v_proj.weight": (kv, d),
    "self_attn.o_proj.weight": (d, q),
    "mlp.gate_proj.weight": (f, d),
    "mlp.up_proj.weight": (f, d),
    "mlp.down_proj.weight": (d, f),
    "input_layernorm.weight": (d,),
    "post_attention_layernorm.weight": (d,),
  }
  weight_map, count = {}, 0
  files = [f"model-{k + 1:05d}-of-{layers + 1:05d}.safetensors" for k in range(layers + 1)]
  for i in range(layers):  # one layer's tensors at a time: the writer never holds the model
    tensors = {f"model.layers.{i}.{n}": random(*s) for n, s in shapes.items()}
    write_file(os.path.join(folder, files[i]), tensors)
    weight_map.update(dict.fromkeys(tensors, files[i]))
    count += sum(t.size for t in tensors.values())
  rest = {
    "model.embed_tokens.weight": random(v, d),
    "lm_head.weight": random(v, d),
    "model.norm.weight": random(d),
  }
  write_file(os.path.join(folder, files[-1]), rest)
  weight_map.update(dict.fromkeys(rest, files[-1]))
  count += sum(t.size for t in rest.values())
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as out:
    json.dump({"metadata": {"total_size": 2 * count}, "weight_map": weight_map}, out)
  config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": layers,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": max_position_embeddings,
    "torch_dtype": "bfloat16",
    **shape,
  }
  with open(os.path.join(folder, "config.json"), "w") as out:
    json.dump(config, out)
  return count


def _peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(folder: str) -> None:
  """One process of the import: FSDP over every device; prints its RSS rise as JSON."""
  import jax

  import spmd
  from configs import hf
  from spmd.mesh import create_mesh
  from trainers.hf import checkpoint
  from trainers.step.state import make_state
  from trainers.tasks import make_task

  spmd.initialize()
  config = hf.get_config(folder)
  config.mesh.ici = "data=1,fsdp=-1,tensor=1"
  mesh = create_mesh(config.mesh.ici)
  setup = make_state(make_task(config).model, config, mesh, ("data", "fsdp"))
  target = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    setup.abstract["params"],
    setup.shardings["params"],
  )
  before = _peak_rss_bytes()
  started = time.perf_counter()
  params = checkpoint.read_params(folder, target)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - started
  rise = _peak_rss_bytes() - before
  count = sum(leaf.size for leaf in jax.tree.leaves(params))
  result = {"process": jax.process_index(), "rise": rise, "params": count, "seconds": seconds}
  print(RESULT + json.dumps(result), flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=18)
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument(
    "--vocab-size", type=int, default=SHAPE["vocab_size"], help="shrink the folder (tests)"
  )
  parser.add_argument("--workdir", default="workdir/bench/hf_import")
  parser.add_argument("--worker", default="", help="(internal) import this folder and report")
  parser.add_argument("--json")
  args = parser.parse_args()
  if args.worker:
    worker(args.worker)
    return
  from benchmarks import common
  from launch.local import run_local

  folder = os.path.abspath(os.path.join(args.workdir, f"llama_{args.layers}_layers"))
  count = write_folder(folder, args.layers, vocab_size=args.vocab_size)
  command = [sys.executable, "-m", "benchmarks.hf_import", f"--worker={folder}"]
  result = run_local(
    command,
    num_processes=args.processes,
    devices_per_process=1,
    timeout_s=900,
    echo=False,
    cwd=ROOT,
    env={"PYTHONPATH": ROOT},
  )
  shutil.rmtree(folder)  # gigabytes of random numbers: written again by the next run
  if not result.ok:
    raise RuntimeError(result.report())
  rows = [
    json.loads(line[len(RESULT) :])
    for p in result.processes
    for line in p.output.splitlines()
    if line.startswith(RESULT)
  ]
  worst = max(rows, key=lambda r: r["rise"])
  f32_bytes = 4 * count
  mib = 2**20
  common.emit(
    [
      common.row(
        "I1",
        f"peak RSS rise of one process importing an HF folder ÷ the model's f32 bytes "
        f"({args.processes} processes, FSDP)",
        worst["rise"] / f32_bytes,
        0.4,
        True,
        f"{count / 1e9:.2f}B parameters, bf16 files; process {worst['process']} rose "
        f"{worst['rise'] / mib:.0f} MiB of {f32_bytes / mib:.0f} MiB (own share "
        f"{1 / args.processes:.2f}) in {worst['seconds']:.1f} s",
        common.machine(f"{args.processes} processes x 1 CPU device"),
      )
    ],
    args.json,
  )


if __name__ == "__main__":
  main()
