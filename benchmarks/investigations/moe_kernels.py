"""The MoE shape's step (E-P9) on one TPU chip with each grouped-matmul kernel, side by side.

  python -m benchmarks.investigations.moe_kernels [--variants=xla,gmm] [--trace_steps=3]

Compiles `configs/llama_tpu_shape_moe.py`'s train step once per variant
(`trainers.models.moe.ROW_KERNEL`, and gmm's row tile), times it on a
synthetic batch (`benchmarks.tpu_check.on_device`) and, for the first
variant, names the step's top operations by device time. A variant is
`xla` or `gmm[:ROWS[:IN[:OUT]]]` (gmm with tiles of at most these sizes). Writes
`$OUT/moe_kernels.json`. The runs are in docs/engineering-log.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import tpu_check, tpu_shapes  # noqa: E402
from trainers.models import moe  # noqa: E402


def run_variant(name: str, rows: int, steps: int, trace_steps: int, tiny: bool) -> dict:
  kernel, *most = name.split(":")
  moe.ROW_KERNEL = kernel
  sizes = (1024, 512, 256, 128)
  moe._GMM_TILES = tuple(
    tuple(t for t in sizes if t <= int(cap)) for cap in (*most, *(["1024"] * 3))[:3]
  )
  config = tpu_shapes.shape_config("moe", tiny=tiny)
  config.global_batch = rows
  out = tpu_check.on_device(config, steps=steps, warmup=2, trace_steps=trace_steps)
  return {"variant": name, "rows": rows, **{k: v for k, v in out.items() if k != "profile"}} | (
    {"profile": out["profile"]} if "profile" in out else {}
  )


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variants", default="xla,gmm")
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--trace_steps", type=int, default=3)
  parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (a dry run)")
  parser.add_argument("--top", type=int, default=40, help="operations the profile names")
  args = parser.parse_args()
  tpu_check.tpu_tuning.profile = functools.partial(tpu_check.tpu_tuning.profile, top=args.top)
  results = []
  for i, name in enumerate(args.variants.split(",")):
    result = run_variant(name, args.rows, args.steps, args.trace_steps if i == 0 else 0, args.tiny)
    results.append(result)
    brief = {
      k: result.get(k) for k in ("variant", "step_s", "mfu", "loss", "peak_bytes", "compile_s")
    }
    print(json.dumps(brief), flush=True)
    for op in result.get("profile", {}).get("top", []):
      print(f"  {op['ms']:8.3f} ms {op['share']:6.1%} {op['name']}: {op['hlo'][:150]}", flush=True)
  out = Path(os.environ.get("OUT", ".")) / "moe_kernels.json"
  out.write_text(json.dumps(results, indent=1, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
