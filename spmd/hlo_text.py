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
_COMPUTATION = re.compile(
  r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$"
)  # lowered HLO: no signature
_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# One computation name, or a braced list of them: `condition=%c, body=%b` must
# yield both names (a pattern allowing ", " would swallow the next keyword).
_CALLS = re.compile(
  r"\b(?:calls|to_apply|body|condition|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"%?([\w.\-]+)\s*=\s*[su]\d+\[\]\S*\s+constant\((\d+)\)")
_BOUND = re.compile(r"ROOT .*compare\(%?([\w.\-]+), %?([\w.\-]+)\), direction=LT")


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


def _trip_count(line: str, computations: dict[str, list[str]], caller: list[str]) -> int:
  """Iterations of the `while` on `line` (in the computation `caller`); 1 when they cannot be told.

  CPU programs say `known_trip_count`; TPU's compiled HLO does not, so the
  loop is read instead: an induction variable (tuple element k) compared
  `< bound` in the condition, its start in the loop's initial tuple and its
  step in the body's result. JAX's loops (`scan`, `fori_loop`) count from 0
  by 1; the loops XLA writes itself need not: a windowed matmul that
  overlaps a weight's all-gather with its use (a "collective matmul") works
  on two shards per iteration, one from each neighbour, and counts by 2, so
  reading only the bound would count its matmuls twice.
  """
  known = _TRIP_COUNT.search(line)
  if known:
    return int(known.group(1))
  condition, body = _CONDITION.search(line), _WHILE.search(line)
  lines = computations.get(condition.group(1), []) if condition else []
  induction = _induction_bound(lines)
  if induction is None:
    return 1
  index, bound = induction
  start = _loop_start(line, caller, index)
  step = _loop_step(computations.get(body.group(1), []) if body else [], index)
  return max(0, -(-(bound - start) // step))


def _instructions(lines: list[str]) -> dict[str, str]:
  """Each named instruction's text after the `=`, by name."""
  found = {}
  for text in lines:
    name, sep, rest = text.strip().removeprefix("ROOT ").partition(" = ")
    if sep:
      found[name.lstrip("%")] = rest
  return found


def _operands(rest: str, op: str) -> list[str]:
  """The operand names of `op(...)` in an instruction's text (shapes and comments dropped)."""
  inside = rest.split(f" {op}(", 1)[1].split(")", 1)[0] if f" {op}(" in rest else ""
  inside = re.sub(r"/\*.*?\*/", "", inside)
  return [a.split()[-1].lstrip("%") for a in inside.split(",") if a.strip()]


def _constant(name: str, instructions: dict[str, str]) -> int | None:
  """The integer constant `name` holds, through copies; None when it is not one."""
  for _ in range(8):
    rest = instructions.get(name, "")
    value = re.search(r"\sconstant\((-?\d+)\)", rest)
    if value:
      return int(value.group(1))
    copied = _operands(rest, "copy")
    if not copied:
      return None
    name = copied[0]
  return None


def _induction_bound(condition: list[str]) -> tuple[int, int] | None:
  """(tuple index, bound) of a loop condition `element < constant`; None if it is not one."""
  instructions = _instructions(condition)
  constants = dict(m.groups() for m in map(_CONSTANT.search, condition) if m)
  for text in condition:
    bound = _BOUND.search(text)
    if not bound or bound.group(2) not in constants:
      continue
    element = re.search(
      r"get-tuple-element\(.*\), index=(\d+)", instructions.get(bound.group(1), "")
    )
    return (int(element.group(1)) if element else 0), int(constants[bound.group(2)])
  return None


def _loop_start(line: str, caller: list[str], index: int) -> int:
  """The induction variable's first value: element `index` of the while's initial tuple, else 0."""
  instructions = _instructions(caller)
  init = _operands(line.split(" = ", 1)[-1], "while")
  elements = _operands(instructions.get(init[0], ""), "tuple") if init else []
  start = _constant(elements[index], instructions) if index < len(elements) else None
  return 0 if start is None else start


def _loop_step(body: list[str], index: int) -> int:
  """What the body adds to element `index` each iteration: `add(element, constant)`, else 1."""
  instructions = _instructions(body)
  root = next((t for t in body if t.strip().startswith("ROOT ")), "")
  elements = _operands(root.split(" = ", 1)[-1], "tuple")
  if index >= len(elements):
    return 1
  added = _operands(instructions.get(elements[index], ""), "add")
  for name in added:
    step = _constant(name, instructions)
    if step is not None and step > 0:
      return step
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
      trips = _trip_count(line, computations, computations[name]) if loop else 1
      for called in _CALLS.findall(line):
        for callee in called.strip("{}").replace("%", "").split(","):
          callee = callee.strip()
          if callee:
            stack.append((callee, times * (trips if callee == body else 1)))
  return runs
