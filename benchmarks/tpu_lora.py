"""L2/L3: LoRA on one TPU chip: the largest Llama it fine-tunes from an HF folder, and its step ÷ full's.

  python3 -m benchmarks.tpu_lora [--out=$OUT/tpu_lora.json]   # one v5e chip: L2, L3 (tens of minutes)
  python3 -m benchmarks.tpu_lora --tiny                        # its smoke run, on a CPU

The family (`FAMILY`): Llama 3's proportions (head dim 128, 8 key/value
heads, SwiGLU width 3.5 x d_model rounded to 256, vocabulary 128,256,
untied), grown in width and depth from 0.38B to 8.0B parameters. Each size
is an HF-format folder of random bf16 weights (`benchmarks.hf_import.
write_folder`, I1's writer), run as a user runs one: `configs/hf.py` on the
folder, `--steps` steps of `train_and_evaluate` (what `spmd-train` runs) on
packed bytes, `--rows` rows of `--seq_len` tokens, full remat, the bf16
policy; LoRA is rank `--rank` on the seven projections.

L2, largest first: a size whose plan for `--topology` (the state alone,
then the step compiled as `spmd-plan` compiles it) says it does not fit is
passed over; the first the plan admits is written and run, and a run the
chip refuses passes to the next size down. Its parameters, tokens/s and
MFU are reported; the MFU counts the forward and input-gradient FLOPs a
LoRA step computes (`trainers.models.llama.flops_per_token`: 4 per matmul
parameter, 6 per adapter parameter, and the attention's), the run's own
`mfu`. Goal: at least 4B parameters. The same search without LoRA gives
where full fine-tuning of the family stops (the issue expects under 1B).

L3: at the largest size full fine-tuning runs, the LoRA step's time ÷ the
full step's, same rows (the median step after the first log interval, which
holds the compile). Goal: at most 0.8.

Prints a table and one JSON line (`--out` too) that
  python -m benchmarks.run --from-tpu-check=tpu_lora.json --only=L2,L3 --update-readme
merges into `benchmarks/latest.json` and the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.hf_import import write_folder  # noqa: E402
from benchmarks.tpu_check_config import TINY  # noqa: E402
from spmd.errors import UserError  # noqa: E402

GOALS = {"L2": 4.0, "L3": 0.8}  # billions of parameters (at least); step ratio (at most)
TARGETS = "q,k,v,o,gate,up,down"


@dataclasses.dataclass(frozen=True)
class Size:
  """One member of the family: its width and depth, and config.json's fields for it."""

  d_model: int
  num_layers: int
  head_dim: int = 128
  kv_heads: int = 8
  vocab_size: int = 128256
  ff_multiple: int = 256

  @property
  def name(self) -> str:
    return f"d{self.d_model}_l{self.num_layers}"

  def hf_shape(self) -> dict:
    """config.json's shape fields: Llama 3's proportions at this width.

    Example:
      >>> Size(3072, 28).hf_shape()["intermediate_size"], Size(3072, 28).hf_shape()["num_attention_heads"]
      (10752, 24)
    """
    ff = round(3.5 * self.d_model / self.ff_multiple) * self.ff_multiple
    return {
      "vocab_size": self.vocab_size,
      "hidden_size": self.d_model,
      "intermediate_size": ff,
      "num_attention_heads": self.d_model // self.head_dim,
      "num_key_value_heads": self.kv_heads,
      "head_dim": self.head_dim,
    }


FAMILY = [
  Size(d, layers)
  for d, layers in (
    (1024, 8),
    (1024, 16),
    (1024, 24),
    (2048, 8),
    (2048, 12),
    (2048, 16),
    (2048, 24),
    (3072, 20),
    (3072, 24),
    (3072, 28),
    (3072, 32),
    (3072, 36),
    (4096, 24),
    (4096, 28),
    (4096, 32),
  )
]
# `--tiny`: the same search on a CPU, two sizes of a small vocabulary.
TINY_FAMILY = [
  Size(d, 2, head_dim=16, kv_heads=2, vocab_size=512, ff_multiple=16) for d in (32, 64)
]


def config_for(folder: Path, args: argparse.Namespace, lora: bool):
  """`configs/hf.py` on `folder` with the benchmark's rows, sequence, remat and LoRA."""
  from configs import hf

  config = hf.get_config(str(folder))
  config.model.seq_len = args.seq_len
  config.model.remat_policy = args.remat
  config.global_batch = args.rows
  config.mesh.ici = "data=1,fsdp=-1,tensor=1"
  config.sample_tokens = 0
  config.data.dir = str(Path(args.workdir) / "data")  # one corpus for every size
  if args.data_source:
    config.data.source = args.data_source
  if args.cache_dir:
    config.compilation_cache_dir = args.cache_dir
  if lora:
    config.lora.targets = TARGETS
    config.lora.rank = args.rank
    config.lora.alpha = 2.0 * args.rank
  return config


def write_shape(size: Size, folder: Path, weights: bool) -> int:
  """`folder` with size's config.json (and random bf16 weights when `weights`); its parameters."""
  shutil.rmtree(folder, ignore_errors=True)
  if weights:
    return write_folder(
      str(folder), size.num_layers, shape=size.hf_shape(), max_position_embeddings=8192
    )
  folder.mkdir(parents=True)
  fields = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": size.num_layers,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
    **size.hf_shape(),
  }
  (folder / "config.json").write_text(json.dumps(fields))
  return 0


def planned(config, topology: str) -> dict:
  """The plan's verdict for `topology`: the state alone first, then the compiled step."""
  from trainers.planning import plan as plan_lib
  from trainers.planning.targets import tpu_target

  target = tpu_target(topology)
  started = time.perf_counter()
  plan = plan_lib.make_plan(config, target, compile_step=False, verify_suggestions=False)
  if plan.fits is not False:  # the state fits: compile the step
    plan = plan_lib.make_plan(config, target, compile_step=True, verify_suggestions=False)
  return {
    "fits": plan.fits,
    "by": plan.verdict_by,
    "total_bytes": plan.memory.total_bytes,
    "state_bytes": plan.memory.state_bytes,
    "seconds": round(time.perf_counter() - started, 1),
  }


def run(config, args: argparse.Namespace, workdir: Path) -> dict:
  """`--steps` steps of the config through `train_and_evaluate`: its steady rates, or its error."""
  from benchmarks.tpu_shapes import through_spmd_train

  try:
    return through_spmd_train(config, args.steps, workdir)
  except (UserError, jax.errors.JaxRuntimeError, MemoryError) as e:
    return {"error": " ".join(str(e).split())[:600]}
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
    gc.collect()


def largest(
  family: list[Size], args: argparse.Namespace, lora: bool, entries: dict, below: int | None = None
) -> Size | None:
  """The largest size (under index `below`) that the plan admits and a real run confirms."""
  mode = "lora" if lora else "full"
  work = Path(args.workdir)
  for index in reversed(range(len(family) if below is None else below)):
    size = family[index]
    entry = entries.setdefault(size.name, {"d_model": size.d_model, "num_layers": size.num_layers})
    shape_folder = work / "shapes" / size.name
    write_shape(size, shape_folder, weights=False)
    config = config_for(shape_folder, args, lora)
    entry["params"] = _params(config)
    if args.topology:
      entry[f"{mode}_plan"] = planned(config, args.topology)
      print(f"{size.name} {mode}: plan {entry[f'{mode}_plan']}", flush=True)
      _keep(args, entries)
      if entry[f"{mode}_plan"]["fits"] is False:
        continue
    folder = work / "folders" / size.name
    write_shape(size, folder, weights=True)
    try:
      entry[mode] = run(config_for(folder, args, lora), args, work / "runs" / f"{size.name}_{mode}")
    finally:
      shutil.rmtree(folder, ignore_errors=True)  # gigabytes a size
    print(f"{size.name} {mode}: run {entry[mode]}", flush=True)
    _keep(args, entries)
    if "error" not in entry[mode]:
      return size
  return None


def _keep(args: argparse.Namespace, entries: dict) -> None:
  """The sizes so far in `--out`.partial: a run stopped by its time limit keeps what it measured."""
  if args.out:
    Path(args.out + ".partial").write_text(json.dumps(entries, indent=1, default=str))


def _params(config) -> int:
  from trainers.models.llama import param_count
  from trainers.tasks.llama import llama_config

  return param_count(llama_config(config))


def measure(args: argparse.Namespace, family: list[Size]) -> dict:
  """The search for L2, where full fine-tuning stops, and L3 at that size."""
  entries: dict = {}
  lora = largest(family, args, lora=True, entries=entries)
  full = largest(family, args, lora=False, entries=entries)
  out: dict = {"sizes": entries}
  if lora is not None:
    e = entries[lora.name]
    out["l2"] = {"size": lora.name, "params": e["params"], **e["lora"]}
  if full is not None:
    out["full_stops"] = {"size": full.name, "params": entries[full.name]["params"]}
    index = family.index(full)
    if index + 1 < len(family):
      above = family[index + 1]
      out["full_stops"]["next"] = {"size": above.name, **entries.get(above.name, {})}
    both = entries[full.name]
    if "lora" not in both:  # LoRA at the size full fine-tuning runs, same rows
      shape_folder = Path(args.workdir) / "folders" / full.name
      write_shape(full, shape_folder, weights=True)
      try:
        both["lora"] = run(
          config_for(shape_folder, args, lora=True), args, Path(args.workdir) / "runs" / "l3"
        )
      finally:
        shutil.rmtree(shape_folder, ignore_errors=True)
    if "error" not in both["lora"]:
      out["l3"] = {
        "size": full.name,
        "params": both["params"],
        "lora_step_s": both["lora"]["step_s"],
        "full_step_s": both["full"]["step_s"],
        "value": both["lora"]["step_s"] / both["full"]["step_s"],
      }
  return out


def table(report: dict) -> list[str]:
  lines = [f"\nLoRA and full fine-tuning on {report['device_kind']} (jax {report['jax']})"]
  for name, e in report["sizes"].items():
    words = []
    for mode in ("lora", "full"):
      plan = e.get(f"{mode}_plan")
      if plan:
        words.append(f"{mode} plan {'fits' if plan['fits'] else 'refused'}")
      if mode in e:
        ran = e[mode]
        rate = "error" if "error" in ran else f"{ran['tokens_per_s']:,.0f} tok/s"
        words.append(f"{mode} {rate}")
    lines.append(f"  {name:<12} {e.get('params', 0) / 1e9:5.2f}B  " + ", ".join(words))
  for key in ("l2", "full_stops", "l3"):
    if key in report:
      lines.append(f"  {key}: {report[key]}")
  return lines


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=4, help="rows a step (the issue: at least 4)")
  parser.add_argument("--seq_len", type=int, default=2048)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--remat", default="full", help="model.remat_policy")
  parser.add_argument("--steps", type=int, default=12, help="train steps a run (at least 2)")
  parser.add_argument("--topology", default="v5e-1", help="the plan's target ('': no plan)")
  parser.add_argument("--tiny", action="store_true", help="CPU-sized: two small sizes, no plan")
  parser.add_argument("--workdir", default="/tmp/spmd_tpu_lora", help="folders, runs, data")
  parser.add_argument("--data_source", default="", help="data.source (default: the stdlib)")
  parser.add_argument("--cache_dir", default="", help="the compilation cache (default: config's)")
  parser.add_argument(
    "--sizes", default="", help="only these sizes of the family, e.g. d1024_l8,d3072_l32"
  )
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error(f"--steps={args.steps}: at least 2 (one to compile, one timed)")
  family = FAMILY
  if args.tiny:  # no plan, unless --topology is given after --tiny's default
    family = TINY_FAMILY
    args.topology = "" if "--topology" not in " ".join(argv or sys.argv[1:]) else args.topology
    args.seq_len = min(args.seq_len, TINY["seq_len"])  # tpu_shapes' too: one corpus for both
    args.rows = max(args.rows, len(jax.devices()))  # a row a CPU device at least
  if args.sizes:  # a search the plan has narrowed on another machine
    names = args.sizes.split(",")
    unknown = sorted(set(names) - {s.name for s in family})
    if unknown:
      parser.error(f"--sizes: {unknown} not in the family {[s.name for s in family]}")
    family = [s for s in family if s.name in names]
  started = time.perf_counter()
  report = {
    **common.chip_header("python3 -m benchmarks.tpu_lora", argv),
    "figure": "L2",
    "rows": args.rows,
    "seq_len": args.seq_len,
    "rank": args.rank,
    "remat": args.remat,
    "topology": args.topology,
    **measure(args, family),
    "seconds": round(time.perf_counter() - started, 1),
  }
  for line in table(report):
    print(line, file=sys.stderr)
  return common.emit_result(report, args.out or None)


if __name__ == "__main__":
  main()
