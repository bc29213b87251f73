"""The knobs the TPU check tunes on the chip (splash's block sizes, its fused backward, the loss's chunk), and the step's profile.

A setting is a dict:
  splash_block         every splash block size (q, kv, their compute, dq and dkv blocks)
  splash_fused_bwd     splash's fused backward kernel (dq and dk/dv in one pass)
  chunk_logits         logits per row of one chunk of the loss (`losses.CHUNK_LOGITS`)
  rows, remat_policy, scan_unroll   the batch, `model.remat_policy` and `model.scan_unroll`
The kernel knobs are set for the whole process (`apply`): they are what the
sweep tries, not options of the product; what wins is made the product's
default (docs/performance.md). `profile` names a step's top operations by
device time, read back from a `jax.profiler` trace's Perfetto file, each
with its HLO instruction. The greedy sweep over the knobs is
`benchmarks/tpu_tuning_sweep.py`; `benchmarks/tpu_check.py --tuning=FILE`
applies its best setting.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from trainers.models import attention  # noqa: E402
from trainers.tasks import losses  # noqa: E402

# What the product does with no tuning applied (the defaults `apply` restores).
DEFAULTS = {
  "splash_block": None,  # the largest of attention.SPLASH_BLOCKS that divides the sequence
  "splash_fused_bwd": attention.SPLASH_FUSED_BACKWARD,
  "chunk_logits": losses.CHUNK_LOGITS,
}
_PRODUCT_BLOCKS = attention.SPLASH_BLOCKS


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
  # Read when each kernel's block sizes are made (`attention._block_sizes`).
  attention.SPLASH_FUSED_BACKWARD = bool(knobs["splash_fused_bwd"])
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
# The profile: device time by operation, from the trace's Perfetto file.

_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")


def top_ops(trace_events: list[dict], steps: int, hlo_text: str, top: int = 15) -> list[dict]:
  r"""The `top` HLO operations by summed duration per step, on the device that ran most.

  Only events named after an instruction of `hlo_text` count (a device's
  ops, not the host's calls), and no loop or call (`while`, `call`,
  `conditional`): their bodies' ops are counted themselves. The events of
  each process are summed by name; the process whose ops took longest is
  the device. Each op carries its share of that device's busy time and its
  HLO instruction, shortened.

  Example:
    >>> events = [{"ph": "X", "pid": 1, "name": "fusion.1", "dur": 3000},
    ...           {"ph": "X", "pid": 1, "name": "fusion.2", "dur": 1000},
    ...           {"ph": "X", "pid": 2, "name": "host_call", "dur": 9000}]
    >>> hlo = "%fusion.1 = f32[2] add(a, b)\n%fusion.2 = f32[2] add(a, b)"
    >>> [(o["name"], o["ms"], o["share"]) for o in top_ops(events, 1, hlo)]
    [('fusion.1', 3.0, 0.75), ('fusion.2', 1.0, 0.25)]
  """
  text = {m.group(1): m.group(2) for m in map(_OP.match, hlo_text.splitlines()) if m}
  per_pid: dict = collections.defaultdict(collections.Counter)
  for e in trace_events:
    name = e.get("name", "")
    if e.get("ph") != "X" or "dur" not in e or name not in text:
      continue
    if name.startswith(("while", "call", "cond")):
      continue
    per_pid[e.get("pid")][name] += e["dur"]
  if not per_pid:
    return []
  busiest = max(per_pid.values(), key=lambda c: sum(c.values()))
  whole = sum(busiest.values())
  return [
    {
      "name": name,
      "ms": round(us / 1e3 / steps, 3),
      "share": round(us / whole, 4),
      "hlo": re.sub(r"metadata=\{[^}]*\}", "", text[name])[:200],
    }
    for name, us in busiest.most_common(top)
  ]


def profile(
  compiled, state, batch, steps: int, hlo_text: str, top: int = 15
) -> tuple[dict, object]:
  """Traces `steps` calls of `compiled`; returns (its `top` ops and their device names, the state)."""
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
    found = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    files = sorted(
      os.path.relpath(p, trace_dir) for p in glob.glob(f"{trace_dir}/**/*", recursive=True)
    )
    if not found:
      return {"error": "no perfetto_trace.json.gz", "files": files}, state
    with gzip.open(found[0]) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {
    e.get("pid"): e.get("args", {}).get("name")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  ops = top_ops(events, steps, hlo_text, top=top)
  busy = sum(o["ms"] for o in top_ops(events, steps, hlo_text, top=10**6))
  return {"processes": names, "top": ops, "busy_ms_per_step": busy, "files": files}, state
