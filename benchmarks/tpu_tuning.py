"""The knobs the TPU check tunes on the chip: splash's block sizes, its fused backward, the loss's chunk.

  python -m benchmarks.tpu_tuning [--rows=8] [--steps=6] [--out=FILE] [--budget_s=240]   # on the chip
  python -m benchmarks.tpu_tuning --tiny                                                # its test, on a CPU

First it traces a few steps of the TPU check's 501M Llama step (`configs/llama_tpu_check.py`)
with `jax.profiler` and names its top operations by device time (read back
from the trace's Perfetto file, each with its HLO instruction). Then it
tries the knobs one at a time on top of the best so far (a greedy sweep),
keeping a knob only when the step's tokens/s rise, and writes the best
setting (`--out`), which `benchmarks/tpu_check.py --tuning=FILE` applies
before it measures P9, P11 and P4.

A setting is a dict:
  splash_block         every splash block size (q, kv, their compute, dq and dkv blocks)
  splash_fused_bwd     splash's fused backward kernel (dq and dk/dv in one pass)
  chunk_logits         logits per row of one chunk of the loss (`losses.CHUNK_LOGITS`)
  rows, remat_policy, scan_unroll   the batch, `model.remat_policy` and `model.scan_unroll`
The kernel knobs are set for the whole process (`apply`): they are what the
sweep tries, not options of the product; what wins is made the product's
default (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import tpu_step  # noqa: E402
from trainers.models import attention  # noqa: E402
from trainers.tasks import losses  # noqa: E402

# What the product does with no tuning applied (the defaults `apply` restores).
DEFAULTS = {
  "splash_block": None,  # the largest of attention.SPLASH_BLOCKS that divides the sequence
  "splash_fused_bwd": attention.SPLASH_FUSED_BACKWARD,
  "chunk_logits": losses.CHUNK_LOGITS,
}
_PRODUCT_BLOCKS = attention.SPLASH_BLOCKS
_PRODUCT_LOCAL = attention._splash_local


def _splash_local_with(fused_bwd: bool):
  """`attention._splash_local` with splash's fused backward kernel on or off."""
  splash, splash_mask = attention.splash, attention.splash_mask

  def local(q, k, v, segment_ids, *, block: int, interpret: bool):
    _, length, heads, head_dim = q.shape
    dq = None if fused_bwd else block
    sizes = splash.BlockSizes(
      block_q=block,
      block_kv=block,
      block_kv_compute=block,
      block_q_dkv=block,
      block_kv_dkv=block,
      block_kv_dkv_compute=block,
      block_q_dq=dq,
      block_kv_dq=dq,
      use_fused_bwd_kernel=fused_bwd,
    )
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((length, length))] * heads)
    kernel = splash.make_splash_mha(
      mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    q = jnp.swapaxes(q * jnp.asarray(head_dim**-0.5, q.dtype), 1, 2)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    if segment_ids is None:
      y = jax.vmap(kernel)(q, k, v)
    else:
      ids = segment_ids.astype(jnp.int32)
      y = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(
        q, k, v, ids
      )
    return jnp.swapaxes(y, 1, 2)

  return local


def apply(setting: dict) -> None:
  """Sets the kernel knobs of `setting` for this process (missing ones: the product's defaults).

  Example:
    >>> apply({"chunk_logits": 2**20}); losses.CHUNK_LOGITS
    1048576
    >>> apply({}); losses.CHUNK_LOGITS == DEFAULTS["chunk_logits"]
    True
  """
  unknown = set(setting) - set(DEFAULTS) - set(_CONFIG_KNOBS)
  if unknown:
    raise ValueError(f"unknown tuning knobs {sorted(unknown)}; known: {sorted(DEFAULTS)}")
  knobs = {**DEFAULTS, **{k: v for k, v in setting.items() if k in DEFAULTS}}
  block = knobs["splash_block"]
  # The block first, then the product's smaller ones for sequences it does not divide.
  attention.SPLASH_BLOCKS = _PRODUCT_BLOCKS
  if block is not None:
    attention.SPLASH_BLOCKS = (int(block), *(b for b in _PRODUCT_BLOCKS if b < int(block)))
  fused = bool(knobs["splash_fused_bwd"])
  product = fused == attention.SPLASH_FUSED_BACKWARD
  attention._splash_local = _PRODUCT_LOCAL if product else _splash_local_with(fused)
  losses.CHUNK_LOGITS = int(knobs["chunk_logits"])


_CONFIG_KNOBS = ("rows", "remat_policy", "scan_unroll", "nonfinite_guard")


def configure(config, setting: dict):
  """`config` with the setting's rows, remat policy and unroll (kernel knobs go through `apply`)."""
  if "rows" in setting:
    config.global_batch = int(setting["rows"])
  if "remat_policy" in setting:
    config.model.remat_policy = setting["remat_policy"]
  if "scan_unroll" in setting:
    config.model.scan_unroll = int(setting["scan_unroll"])
  if "nonfinite_guard" in setting:
    config.train.nonfinite_guard = setting["nonfinite_guard"]
  return config


# ---------------------------------------------------------------------------
# The sweep.

# The alternatives to the product's defaults (which the first sweep, from
# blocks of 512 and two backward kernels, chose: docs/performance.md).
CANDIDATES = [
  {"splash_fused_bwd": False},
  {"splash_block": 512},
  {"splash_block": 2048},
  {"chunk_logits": 2**24},  # chunks of 512 tokens at a 32000 vocabulary
  {"scan_unroll": 2},
  {"nonfinite_guard": "branch"},
  {"rows": 10},  # last: a batch that compiles may still fail at run time
]


def measure(setting: dict, rows: int, steps: int, tiny: bool, trace_steps: int = 0) -> dict:
  """Tokens/s (and MFU) of the check's step under `setting`; a refusal is recorded, not raised."""
  apply(setting)
  config = configure(tpu_step.check_config(rows, tiny), setting)
  try:
    measured = tpu_step.on_device(config, steps, warmup=2, trace_steps=trace_steps)
  except Exception as e:  # a kernel that does not compile, an out-of-memory at run time
    return {"setting": setting, "compiled": False, "error": " ".join(str(e).split())[:300]}
  return {"setting": setting, **measured}


def sweep(rows: int, steps: int, tiny: bool, budget_s: float, log=print, save=None) -> dict:
  """The profile of the default step, then the greedy sweep over `CANDIDATES`.

  `save(report)` is called after each trial with the report so far (a crash
  of the process keeps what was measured).
  """
  started = time.perf_counter()
  base = measure({}, rows, steps, tiny, trace_steps=3)
  log(f"default, {rows} rows: {_brief(base)}")
  for op in base.get("profile", {}).get("top", []):
    log(f"  {op['ms']:8.2f} ms {op['share']:6.1%}  {op['name']}: {op['hlo'][:120]}")
  best, best_rate, tried = {}, base.get("tokens_per_s") or 0.0, []
  for candidate in CANDIDATES:
    if time.perf_counter() - started > budget_s:
      log(f"sweep: the {budget_s:.0f} s budget is spent; not tried: {candidate}")
      tried.append({"setting": {**best, **candidate}, "skipped": "budget"})
      continue
    setting = {**best, **candidate}
    result = measure(setting, int(setting.get("rows", rows)), steps, tiny)
    result.pop("profile", None)
    tried.append(result)
    log(f"{setting}: {_brief(result)}")
    rate = result.get("tokens_per_s") or 0.0
    if rate > best_rate:
      best, best_rate = setting, rate
    if save:
      save(report(base, tried, best, best_rate, started))
  apply({})
  return report(base, tried, best, best_rate, started)


def report(base: dict, tried: list, best: dict, best_rate: float, started: float) -> dict:
  """The sweep's report: the default step (with its profile), each trial, the best setting."""
  return {
    "default": base,
    "tried": tried,
    "best": best,
    "best_tokens_per_s": best_rate,
    "sweep_s": time.perf_counter() - started,
  }


def _brief(r: dict) -> str:
  if not r.get("compiled"):
    return f"refused or failed: {(r.get('refusal') or r.get('error') or '')[:160]}"
  mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") else ""
  return f"{r['step_s'] * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s{mfu}, temps {r['temp_bytes'] / 2**30:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--budget_s", type=float, default=240, help="no new candidate after this")
  parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (its test)")
  parser.add_argument("--out", default=os.environ.get("OUT", ".") + "/tpu_tuning.json")
  args = parser.parse_args(argv)
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  machine = {"device_kind": jax.local_devices()[0].device_kind, "jax": jax.__version__}

  def save(found: dict) -> None:
    Path(args.out).write_text(json.dumps({**found, **machine}, indent=1, default=str))

  found = sweep(
    args.rows, args.steps, args.tiny, args.budget_s, log=lambda s: print(s, flush=True), save=save
  )
  save(found)
  print(
    f"best: {found['best']} ({found['best_tokens_per_s']:,.0f} tokens/s); written to {args.out}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
