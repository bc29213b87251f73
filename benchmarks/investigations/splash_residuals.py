"""Keeping splash's residuals under remat: what the step saves in time and costs in memory, on the chip.

  python3 -m benchmarks.investigations.splash_residuals [--rows=8] [--steps=10] [--moe_rows=8]

The remat policies keep some named outputs of each layer; splash's own
residuals (its output and log-sum-exp) are not among them, so the backward
pass runs each layer's attention forward kernel again to get them. Splash
names them `attention.SPLASH_RESIDUALS` when asked (`residual_checkpoint_name`),
and a policy can then keep them. Each variant is the TPU check's step
(`benchmarks.tpu_check.on_device`, synthetic batches) with one policy in
place of the config's:
  default        the config's policy as the product defines it
  no_qkv+core    "minimal_no_qkv" plus the splash residuals
  minimal+core   "minimal" (every weight matmul's output) plus the splash residuals
Each reports its step time, MFU, the compiler's peak and whether XLA
rematerialized to fit (`.remat` in the optimized HLO). The MoE shape
(`configs/llama_tpu_shape_moe.py`) runs default and no_qkv+core, then with
megablox's `tgmm` for the weight gradients at each of `--tgmm_tilings`
("xla": XLA's ragged dot; "auto": the product's tiles; `moe.WEIGHT_GRADIENT_KERNEL`). Prints one JSON line a variant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from benchmarks import tpu_check  # noqa: E402
from benchmarks.tpu_check_config import check_config  # noqa: E402
from configs import llama_tpu_shape_moe  # noqa: E402
from trainers.config import resolve  # noqa: E402
from trainers.models import attention, layers, moe  # noqa: E402

POLICIES = jax.checkpoint_policies
KEPT = ("attention_out", "mlp_gate", "mlp_up")
VARIANTS = {
  "no_qkv+core": POLICIES.save_only_these_names(*KEPT, attention.SPLASH_RESIDUALS),
  "minimal+core": POLICIES.save_from_both_policies(
    POLICIES.dots_with_no_batch_dims_saveable,
    POLICIES.save_only_these_names(attention.SPLASH_RESIDUALS),
  ),
}


def run(name: str, config, steps: int) -> dict:
  original = dict(layers.CHECKPOINT_POLICIES)
  if name != "default":
    layers.CHECKPOINT_POLICIES[config.model.remat_policy] = VARIANTS[name]
  try:
    out = tpu_check.on_device(config, steps, warmup=2)
  except Exception as e:  # a variant that does not fit at run time
    out = {"compiled": False, "error": " ".join(str(e).split())[:300]}
  finally:
    layers.CHECKPOINT_POLICIES.clear()
    layers.CHECKPOINT_POLICIES.update(original)
  keep = ("compiled", "step_s", "mfu", "total_bytes", "temp_bytes", "refusal", "error")
  return {k: out[k] for k in keep if k in out}


def tgmm_agrees() -> float:
  """The largest difference between tgmm's and XLA's weight gradients, groups of uneven sizes."""
  import jax.numpy as jnp

  kx, kg = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (2048, 512), jnp.bfloat16)
  g = jax.random.normal(kg, (2048, 1024), jnp.bfloat16)
  sizes = jnp.array([100, 0, 700, 1248], jnp.int32)
  tgmm = ((512, 512, 512), False)
  ours = jax.jit(moe._weight_gradient, static_argnums=3)(x, g, sizes, tgmm)
  xla = jax.jit(moe._weight_gradient, static_argnums=3)(x, g, sizes, None)
  return float(jnp.max(jnp.abs(ours - xla)) / jnp.max(jnp.abs(xla)))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--moe_rows", type=int, default=8)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--variants", default="default,no_qkv+core,minimal+core")
  parser.add_argument("--moe_variants", default="default,no_qkv+core")
  parser.add_argument("--tgmm_tilings", default="512x1024x1024,512x512x512,1024x512x1024,auto")
  parser.add_argument("--tgmm_variant", default="default", help="the policy the tgmm runs use")
  args = parser.parse_args()
  for name in filter(None, args.variants.split(",")):
    row = run(name, check_config(args.rows), args.steps)
    print(json.dumps({"model": "check", "rows": args.rows, "variant": name, **row}), flush=True)
  moe_config = llama_tpu_shape_moe.get_config()
  moe_config.global_batch = args.moe_rows
  moe_config = resolve(moe_config, ROOT / "configs" / "llama_tpu_shape_moe.py")
  for name in filter(None, args.moe_variants.split(",")):
    row = run(name, moe_config, args.steps)
    print(json.dumps({"model": "moe", "rows": args.moe_rows, "variant": name, **row}), flush=True)
  print(json.dumps({"tgmm_equals_xla": tgmm_agrees()}), flush=True)
  for tiling in filter(None, args.tgmm_tilings.split(",")):
    moe.WEIGHT_GRADIENT_KERNEL = "xla" if tiling == "xla" else "tgmm"
    if tiling not in ("xla", "auto"):
      moe._TGMM_TILES = tuple((int(t),) for t in tiling.split("x"))
    row = run(args.tgmm_variant, moe_config, args.steps)
    print(json.dumps({"model": "moe", "rows": args.moe_rows, "tgmm": tiling, **row}), flush=True)


if __name__ == "__main__":
  main()
