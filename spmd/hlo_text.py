"""An optimised HLO module's text: its computations, how often each runs, array sizes.

XLA prints a compiled program (`compiled.as_text()`) as named computations:
the entry, loop bodies and conditions, fusions and reductions that others
call. What the readers of this text (`spmd.hlo` for collectives,
`spmd.hlo_matmuls` for matmul FLOPs) need alike is which computations run
and how many times per call of the entry: a `while` body once per
iteration, when the trip count is stated or can be read off the loop
condition.

Example:
  >>> text = '''ENTRY %main (p: f32[8]) -> f32[8] {
  ...   ROOT %p = f32[8]{0} parameter(0)
  ... }'''
  >>> [(name, times) for name, times, _ in executed_computations(text)]
  [('main', 1)]
  >>> array_bytes("(f32[8]{0}, bf16[2,4]{1,0})")
  [32, 16]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
# One array type, e.g. `f32[8,4]`: its dtype and dimensions.
ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# One computation name, or a braced list of them: `condition=%c, body=%b` must
# yield both names (a pattern allowing ", " would swallow the next keyword).
_CALLS = re.compile(
  r"\b(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"%?([\w.\-]+)\s*=\s*[su]\d+\[\]\S*\s+constant\((\d+)\)")
_BOUND = re.compile(r"ROOT .*compare\(%?[\w.\-]+, %?([\w.\-]+)\), direction=LT")


def parse_dims(text: str) -> list[int]:
  """`"8,4"` (the inside of `f32[8,4]`) as `[8, 4]`."""
  return [int(d) for d in text.split(",") if d]


def array_bytes(shape_text: str) -> list[int]:
  """The bytes of each array of known dtype in a (tuple) shape, in order."""
  sizes = []
  for dtype, dimensions in ARRAY.findall(shape_text):
    if dtype in DTYPE_BYTES:
      size = math.prod(int(d) for d in dimensions.split(",") if d) if dimensions else 1
      sizes.append(size * DTYPE_BYTES[dtype])
  return sizes


def executed_computations(hlo_text: str) -> Iterator[tuple[str, int, list[str]]]:
  """(name, executions per call of the entry, lines) of each computation that runs."""
  computations, entry = _split_computations(hlo_text)
  runs = _executions(computations, entry)
  for name, body in computations.items():
    times = runs.get(name, 0 if entry else 1)
    if times:
      yield name, times, body


def _split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  computations: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
    elif current is not None:
      if line.strip() == "}":
        current = None
      else:
        computations[current].append(line)
  return computations, entry


def _trip_count(line: str, computations: dict[str, list[str]]) -> int:
  """Iterations of the `while` on `line`; 1 when they cannot be told.

  CPU programs say `known_trip_count`; TPU's compiled HLO does not,
  so the loop condition is read instead: JAX's loops (`scan`, `fori_loop`,
  so a model scanning over its layers) count an induction variable up from
  0 by 1 while it is less than a constant.
  """
  known = _TRIP_COUNT.search(line)
  if known:
    return int(known.group(1))
  condition = _CONDITION.search(line)
  lines = computations.get(condition.group(1), []) if condition else []
  constants = dict(m.groups() for m in map(_CONSTANT.search, lines) if m)
  for cond_line in lines:
    bound = _BOUND.search(cond_line)
    if bound and bound.group(1) in constants:
      return int(constants[bound.group(1)])
  return 1


def _executions(computations: dict[str, list[str]], entry: str | None) -> dict[str, int]:
  """How often each computation runs per call of the entry (while trip counts)."""
  if entry is None:
    return {name: 1 for name in computations}
  runs: dict[str, int] = {}
  stack = [(entry, 1)]
  while stack:
    name, times = stack.pop()
    if name not in computations or runs.get(name, 0) >= times:
      continue
    runs[name] = times
    for line in computations[name]:
      loop = _WHILE.search(line)
      body = loop.group(1) if loop else None
      trips = _trip_count(line, computations) if loop else 1
      for called in _CALLS.findall(line):
        for callee in called.strip("{}").replace("%", "").split(","):
          callee = callee.strip()
          if callee:
            stack.append((callee, times * (trips if callee == body else 1)))
  return runs
