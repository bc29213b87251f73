"""The greedy sweep of the TPU check's knobs (`benchmarks/tpu_tuning.py`) on the chip.

  python -m benchmarks.tpu_tuning_sweep [--rows=8] [--steps=6] [--out=FILE] [--budget_s=240]   # on the chip
  python -m benchmarks.tpu_tuning_sweep --tiny                                                # its test, on a CPU

First it traces a few steps of the TPU check's 501M Llama step (`configs/llama_tpu_check.py`)
with `jax.profiler` and names its top operations by device time
(`tpu_tuning.profile`). Then it tries the knobs one at a time on top of the
best so far, keeping a knob only when the step's tokens/s rise, and writes
the best setting (`--out`), which `benchmarks/tpu_check.py --tuning=FILE`
applies before it measures P9, P11 and P4.
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

from benchmarks import tpu_check, tpu_tuning  # noqa: E402
from benchmarks.tpu_check_config import check_config  # noqa: E402

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
  tpu_tuning.apply(setting)
  config = tpu_tuning.configure(check_config(rows, tiny), setting)
  try:
    measured = tpu_check.on_device(config, steps, warmup=2, trace_steps=trace_steps)
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
  tpu_tuning.apply({})
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
