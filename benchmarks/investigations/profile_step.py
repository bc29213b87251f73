"""Found: matmuls take most of a CPU train step; the untraced gaps are Eigen's asynchronous weight-gradient matmuls.

  python -m benchmarks.investigations.profile_step [--steps=3] [--width=512]

Traces `--steps` steps of the real train step (lm_tiny at `--width`, one
process, `BENCH_DEVICES` CPU devices, default 1) with `jax.profiler`, reads the
Perfetto trace back and sums each executed HLO operation's time into:
matmuls, layout copies (transposes XLA inserts so a dot gets the operand
layout its kernel wants), collectives, the optimizer (with gradient clipping
and metrics: every op outside the differentiated loss)
and other elementwise work (of the loss's forward and backward): where a
step's time goes beside its matmuls. The runs are in
docs/engineering-log.md.

Two columns per kind: the ops' summed durations, and the time at least one
of them ran (XLA:CPU runs independent ops at once, so the sum can exceed
it). The last line says how much of the traced steps' wall time no traced
op covered: there, only what the trace does not show ran, chiefly the
weight-gradient matmuls Eigen runs asynchronously, whose events end when
they are launched.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_DEVICES", "1")))
jax.config.update("jax_platforms", "cpu")

from benchmarks import common  # noqa: E402
from configs import lm_tiny_bytes  # noqa: E402
from spmd.mesh import create_mesh  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402

_OP = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def categories(hlo_text: str) -> dict[str, str]:
  """Each top-level instruction's kind, from the optimised HLO."""
  kinds = {}
  for line in hlo_text.splitlines():
    m = _OP.match(line)
    if not m:
      continue
    name, rest = m.groups()
    op_name = (_OP_NAME.search(rest) or re.match("", "")).group(0)
    if any(f" {c}" in rest.split("(")[0] or name.startswith(c) for c in _COLLECTIVES):
      kinds[name] = "collectives"
    elif "__ynn_fusion" in rest or " dot(" in rest or " convolution(" in rest:
      kinds[name] = "matmuls"
    elif op_name and "jvp(" not in op_name:  # outside the differentiated loss
      kinds[name] = "optimizer, clipping, metrics"
    elif name.startswith(("copy", "transpose")):
      kinds[name] = "layout copies"
    else:
      kinds[name] = "other forward/backward (elementwise, reductions)"
  return kinds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--top", type=int, default=0, help="also list the N slowest ops")
  args = parser.parse_args()
  config = lm_tiny_bytes.get_config()
  config.model.d_model, config.model.num_heads, config.model.d_ff = (
    args.width,
    args.width // 64,
    4 * args.width,
  )
  mesh = create_mesh("data=-1")
  setup, _, batch = common.transformer_setup(config, mesh)
  step = make_train_step(setup, make_task(config), config, mesh, ("data",))
  state = setup.init()
  hlo_text = step.lower(state, batch).compile().as_text()
  kinds = categories(hlo_text)
  for _ in range(2):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      start = time.perf_counter()
      for _ in range(args.steps):
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
      wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    [path] = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  totals: collections.Counter = collections.Counter()
  per_op: collections.Counter = collections.Counter()
  spans = collections.defaultdict(list)  # kind -> (start, end) in µs
  for e in events:
    if e.get("ph") == "X" and e.get("name") in kinds:
      totals[kinds[e["name"]]] += e["dur"] / 1e3 / args.steps
      per_op[e["name"]] += e["dur"] / 1e3 / args.steps
      spans[kinds[e["name"]]].append((e["ts"], e["ts"] + e["dur"]))
  whole = sum(totals.values())
  print(f"lm_tiny at width {args.width}, {jax.device_count()} CPU device(s): ms per step by kind")
  print("| kind | ms summed | share | ms with one running |\n|---|---|---|---|")
  for kind, ms in totals.most_common():
    ran = common.covered(spans[kind]) / 1e3 / args.steps
    print(f"| {kind} | {ms:.1f} | {ms / whole:.0%} | {ran:.1f} |")
  any_op = common.covered([s for kind in spans for s in spans[kind]]) / 1e3 / args.steps
  print(
    f"\nstep {wall_ms:.1f} ms traced; some traced op ran for {any_op:.1f} ms of it, "
    f"none for {wall_ms - any_op:.1f} ms ({1 - any_op / wall_ms:.0%})"
  )
  if args.top:
    text = {m.group(1): m.group(2) for m in map(_OP.match, hlo_text.splitlines()) if m}
    print(f"\nthe {args.top} slowest ops (ms per step, kind, instruction):")
    for name, ms in per_op.most_common(args.top):
      print(f"{ms:7.1f}  {kinds[name][:12]:12}  {name} = {_OP_NAME.sub('', text[name])[:160]}")


if __name__ == "__main__":
  main()
