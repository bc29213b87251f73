"""The step's profile: device time by operation, read back from a `jax.profiler` trace's Perfetto file.

The TPU check (`benchmarks/tpu_step.on_device`), the knob sweep
(`benchmarks/tpu_tuning.py`) and `investigations/p11_extras.py` name a
step's top operations with it, each with its HLO instruction.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax

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
