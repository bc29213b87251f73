"""The collectives and matmul FLOPs of a compiled program, read from its optimised HLO.

XLA's SPMD partitioner decides which collectives a sharded program needs; the
only place to see them is the compiled module. For each collective this
reads its kind, the bytes of its result per device, how many times a step
runs it (instructions inside a `while` body count once per iteration, when
the trip count is stated or can be read off the loop condition), and which
devices form each group, so a planner can tell whether it crosses DCN
(devices of different slices in one group). On multislice TPU the
compiler splits a collective into its in-slice part and a DCN part that it
hands to the megascale runtime as a host-transfer `send`; those count as
crossing DCN (group size 0: the slices, not devices, take part).

Replica groups come in three spellings, all handled: explicit
(`{{0,1},{2,3}}`), iota (`[2,2]<=[4]` or `[2,2]<=[2,2]T(1,0)`) and mesh axes
(`mesh['x'=2,'y'=2] {'y'}`). Group members are the program's partition ids,
the positions in its device assignment (for `jax.jit` over a mesh: the
mesh's devices in flat order).

`matmul_flops` counts the dots and convolutions the same way, once per
execution, which XLA's cost analysis does not do for loop bodies.

Example:
  >>> text = '''ENTRY %main (p: f32[8]) -> f32[8] {
  ...   %p = f32[8]{0} parameter(0)
  ...   ROOT %ar = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  ... }'''
  >>> [c] = collectives(text, device_slices=[0, 0, 1, 1])
  >>> c.kind, c.count, c.bytes, c.group_size, c.crosses_dcn
  ('all-reduce', 1, 32, 2, False)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
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
_NUMPY_DTYPES = {
  "pred": "bool",
  "bf16": "bfloat16",
  **{
    f"{k}{n}": f"{v}{n}"
    for k, v in (("f", "float"), ("s", "int"), ("u", "uint"))
    for n in (8, 16, 32, 64)
  },
}
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(
  r"=\s*(?P<shape>.+?)\s(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
# Multislice TPU programs hand the DCN part of a collective to the megascale
# runtime as a host-transfer `send`, tagged with the collective's kind.
_MEGASCALE_SEND = re.compile(
  r"=\s*(?P<shape>.+?)\ssend\(.*_xla_megascale_transfer_type=\"(?P<kind>\w+)\""
)
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


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective kind over one kind of group, summed over a step."""

  kind: str
  count: int  # executions per step
  bytes: int  # result bytes per device, summed over the executions
  group_size: int  # devices per group (0: not known)
  crosses_dcn: bool | None  # a group spans slices; None: groups not known


def _array_bytes(shape_text: str) -> list[int]:
  sizes = []
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype in _DTYPE_BYTES:
      size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
      sizes.append(size * _DTYPE_BYTES[dtype])
  return sizes


def _result_bytes(shape_text: str, is_async: bool) -> int:
  sizes = _array_bytes(shape_text)
  if not sizes:
    return 0
  if is_async:
    # An async start returns (operands..., results..., context scalars): the
    # results are the second half of the arrays that are not scalars.
    arrays = [s for s in sizes if s > 4] or sizes
    return sum(arrays[len(arrays) // 2 :]) if len(arrays) > 1 else arrays[0]
  return sum(sizes)


def _iota_groups(text: str) -> list[list[int]] | None:
  m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  if not m:
    return None
  group_shape = [int(x) for x in m.group(1).split(",")]
  dims = [int(x) for x in m.group(2).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(x) for x in m.group(3).split(",")])
  return ids.reshape(group_shape[0], -1).tolist()


def _mesh_groups(text: str) -> list[list[int]] | None:
  m = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
  if not m:
    return None
  axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
  names = [a for a, _ in axes]
  sizes = [int(s) for _, s in axes]
  grouped = re.findall(r"'([^']+)'", m.group(2))
  if any(g not in names for g in grouped):
    return None
  ids = np.arange(math.prod(sizes)).reshape(sizes)
  inner = [names.index(g) for g in grouped]
  outer = [i for i in range(len(names)) if i not in inner]
  size = math.prod(sizes[i] for i in inner)
  return ids.transpose(outer + inner).reshape(-1, size).tolist()


def parse_groups(line: str) -> list[list[int]] | None:
  """The device groups of a collective instruction, or None if not recognised.

  Example:
    >>> parse_groups("x = f32[4] all-gather(y), replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}")
    [[0, 2], [1, 3]]
  """
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
  if pairs:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")]
  m = re.search(r"replica_groups=(.*)", line)
  if not m:
    return None
  text = m.group(1)
  if text.startswith("{"):
    body = re.match(r"\{((?:\{[\d,]*\},?)*)\}", text)
    if not body:
      return None
    groups = [
      [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", body.group(1))
    ]
    return groups or None
  if text.startswith("mesh["):
    return _mesh_groups(text)
  return _iota_groups(text)


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


_NAMED_ARRAY = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[a-z]+\d*[a-z0-9]*\[([\d,]*)\]")
_MATMUL = re.compile(
  r"=\s*[a-z]+\d*[a-z0-9]*\[(?P<out>[\d,]*)\]\S*\s(?P<op>dot|convolution)\((?P<args>[^)]*)\)"
)
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(",") if d]


def _operand_dims(args: str, shapes: dict[str, list[int]]) -> list[list[int] | None]:
  """Each operand's dimensions: printed inline (`f32[8,4]{1,0} %a`) or looked up by name."""
  dims = []
  for arg in args.split(", "):
    inline = _ARRAY.search(arg)
    name = arg.split()[-1].lstrip("%") if arg.split() else ""
    dims.append(_dims(inline.group(2)) if inline else shapes.get(name))
  return dims


def _window(line: str, rank: int) -> list[dict[str, int]]:
  """The convolution's window, one dict per spatial dimension, XLA's defaults filled in."""
  fields = [
    {"size": 1, "stride": 1, "pad_low": 0, "lhs_dilate": 1, "rhs_dilate": 1} for _ in range(rank)
  ]
  window = _WINDOW.search(line)
  for item in window.group(1).split() if window else []:
    key, _, value = item.partition("=")
    for field, part in zip(fields, value.split("x")):
      if key == "pad":
        field["pad_low"] = int(part.split("_")[0])
      elif key in field:
        field[key] = int(part)
  return fields


def _reading_positions(out_size: int, in_size: int, window: dict[str, int]) -> int:
  """(output, window) position pairs of one spatial dimension that read real input.

  Padding, strides and dilations are how XLA (on TPU above all) writes
  batched and transposed matmuls as convolutions; most of such a window
  lands on padding or dilation holes, which do no work.
  """
  o = np.arange(out_size)[:, None]
  k = np.arange(window["size"])[None, :]
  pos = o * window["stride"] + k * window["rhs_dilate"] - window["pad_low"]
  dilate = window["lhs_dilate"]
  return int(((pos >= 0) & (pos <= (in_size - 1) * dilate) & (pos % dilate == 0)).sum())


def _convolution_flops(line: str, out: list[int], lhs: list[int], rhs: list[int]) -> int:
  labels = _DIM_LABELS.search(line)
  if not labels:
    return 0
  lhs_labels, rhs_labels, out_labels = labels.groups()
  spatial = sorted(c for c in out_labels if c.isdigit())
  flops = 2 * out[out_labels.index("b")] * out[out_labels.index("f")] * rhs[rhs_labels.index("i")]
  for d, window in zip(spatial, _window(line, len(spatial))):
    flops *= _reading_positions(out[out_labels.index(d)], lhs[lhs_labels.index(d)], window)
  return flops


def _matmuls(hlo_text: str) -> Iterator[tuple[int, str, re.Match, list[int], list[int], list[int]]]:
  """(executions per call, line, match, out, lhs, rhs dims) of each dot and convolution."""
  computations, entry = _split_computations(hlo_text)
  runs = _executions(computations, entry)
  for name, lines in computations.items():
    times = runs.get(name, 0 if entry else 1)
    if not times:
      continue
    shapes = {m.group(1): _dims(m.group(2)) for m in map(_NAMED_ARRAY.match, lines) if m}
    for line in lines:
      m = _MATMUL.search(line)
      if not m:
        continue
      lhs, rhs = [*_operand_dims(m.group("args"), shapes), None, None][:2]
      if lhs is not None and rhs is not None:
        yield times, line, m, _dims(m.group("out")), lhs, rhs


def matmul_flops(hlo_text: str) -> float:
  """FLOPs of the dots and convolutions in an optimised HLO module, per call.

  XLA's own cost analysis counts a `while` body once, so for a model that
  scans over its layers it reports about one layer's worth. This counts
  each dot (2 x output elements x contracted size) and convolution (2 x
  output batch x output features x input features x the window positions
  that read real input) once per execution, loop trip counts included.
  Elementwise work is left out: on accelerators the matmuls are the step.

  Example:
    >>> text = '''ENTRY %main (a: f32[8,32], b: f32[32,16]) -> f32[8,16] {
    ...   %a = f32[8,32]{1,0} parameter(0)
    ...   %b = f32[32,16]{1,0} parameter(1)
    ...   ROOT %d = f32[8,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }'''
    >>> matmul_flops(text) == 2 * 8 * 16 * 32
    True
  """
  total = 0.0
  for times, line, m, out, lhs, rhs in _matmuls(hlo_text):
    if m.group("op") == "dot":
      contracting = _CONTRACTING.search(line)
      inner = math.prod(lhs[i] for i in _dims(contracting.group(1))) if contracting else 1
      flops = 2 * math.prod(out) * inner
    else:
      flops = _convolution_flops(line, out, lhs, rhs)
    total += times * flops
  return total


@dataclasses.dataclass(frozen=True)
class Dot:
  """One dot of an optimised HLO module, as `jax.lax.dot_general` would take it."""

  dtype: str  # the result's, as numpy names it: "float32" (HLO's f32)
  lhs: tuple[int, ...]
  rhs: tuple[int, ...]
  # ((lhs contracting, rhs contracting), (lhs batch, rhs batch)), as dot_general's
  dimension_numbers: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
  count: int  # executions per call

  @property
  def flops(self) -> int:
    """2 x batch x lhs free x rhs free x contracted size, per execution."""
    (contracting, _), (batch, _) = self.dimension_numbers
    # Both operands hold the batch and contracted dimensions: count them once.
    shared = math.prod(self.lhs[i] for i in (*contracting, *batch))
    return 2 * math.prod(self.lhs) * math.prod(self.rhs) // shared


def _dot_numbers(line: str, field: str) -> tuple[int, ...]:
  """A dot's `field={...}` dimension list, e.g. `lhs_batch_dims` (absent: empty)."""
  match = re.search(field + r"=\{([\d,]*)\}", line)
  return tuple(_dims(match.group(1))) if match else ()


def dots(hlo_text: str) -> list[Dot]:
  """The dots of an optimised HLO module (`compiled.as_text()`), in program order.

  What a step multiplies, to replay alone: `benchmarks.common.dots_alone_step`
  times the same dots without anything else of the step.

  Example:
    >>> text = '''ENTRY %main (a: f32[4,8,32], b: f32[4,16,32]) -> f32[4,8,16] {
    ...   %a = f32[4,8,32]{2,1,0} parameter(0)
    ...   %b = f32[4,16,32]{2,1,0} parameter(1)
    ...   ROOT %d = f32[4,8,16]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}
    ... }'''
    >>> [d] = dots(text)
    >>> d.dtype, d.lhs, d.rhs, d.dimension_numbers, d.flops == 2 * 4 * 8 * 16 * 32
    ('float32', (4, 8, 32), (4, 16, 32), (((2,), (2,)), ((0,), (0,))), True)
  """
  found = []
  for times, line, m, _, lhs, rhs in _matmuls(hlo_text):
    if m.group("op") != "dot":
      continue
    hlo_dtype = line.split("=", 1)[1].split("[", 1)[0].strip()
    dtype = _NUMPY_DTYPES.get(hlo_dtype, hlo_dtype)
    found.append(
      Dot(
        dtype,
        tuple(lhs),
        tuple(rhs),
        (
          (_dot_numbers(line, "lhs_contracting_dims"), _dot_numbers(line, "rhs_contracting_dims")),
          (_dot_numbers(line, "lhs_batch_dims"), _dot_numbers(line, "rhs_batch_dims")),
        ),
        times,
      )
    )
  return found


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective instruction of a compiled program, as `collective_ops` reads it."""

  kind: str
  computation: str  # the HLO computation holding it (a loop body, a fusion, the entry)
  executions: int  # per call of the entry: loop trip counts multiplied in
  bytes: int  # result bytes per device, one execution
  groups: list[list[int]] | None  # partition ids of each group; None: not known
  dcn_send: bool  # the DCN part of a multislice collective (a megascale `send`)


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
  """Every collective instruction of an optimised HLO module, where it runs and how often.

  What `collectives` sums up, one instruction at a time: tests use it to
  say which mesh axis a collective runs over (its groups) and whether it
  runs once per layer (its computation is a loop body run once per layer).

  Example:
    >>> text = '''ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   ROOT %ag = f32[8]{0} all-gather(%p), replica_groups=[2,2]<=[4], dimensions={0}
    ... }'''
    >>> [op] = collective_ops(text)
    >>> op.kind, op.computation, op.executions, op.groups
    ('all-gather', 'main', 1, [[0, 1], [2, 3]])
  """
  computations, entry = _split_computations(hlo_text)
  runs = _executions(computations, entry)
  ops = []
  for name, lines in computations.items():
    times = runs.get(name, 0 if entry else 1)
    if times == 0:
      continue
    for line in lines:
      dcn = _MEGASCALE_SEND.search(line)
      if dcn:
        kind = dcn.group("kind").lower().replace("_", "-")
        nbytes = (_array_bytes(dcn.group("shape")) or [0])[0]
        ops.append(CollectiveOp(kind, name, times, nbytes, None, True))
        continue
      m = _INSTRUCTION.search(line)
      if m:
        nbytes = _result_bytes(m.group("shape"), bool(m.group("start")))
        ops.append(CollectiveOp(m.group("kind"), name, times, nbytes, parse_groups(line), False))
  return ops


def collectives(hlo_text: str, device_slices: Sequence[int] | None = None) -> list[Collective]:
  """The collectives in an optimised HLO module, grouped by kind and group shape.

  Args:
    hlo_text: `compiled.as_text()`.
    device_slices: slice index of each partition id (the program's device
      assignment in order), to tell whether a group crosses DCN.
  """
  totals: dict[tuple[str, int, bool | None], list[int]] = {}
  for op in collective_ops(hlo_text):
    if op.dcn_send:
      key = (op.kind, 0, True)
    else:
      crosses = None
      if op.groups is not None and device_slices is not None:
        crosses = any(len({device_slices[i] for i in g}) > 1 for g in op.groups)
      key = (op.kind, len(op.groups[0]) if op.groups else 0, crosses)
    count, total = totals.get(key, [0, 0])
    totals[key] = [count + op.executions, total + op.executions * op.bytes]
  order = {kind: i for i, kind in enumerate(KINDS)}
  return [
    Collective(kind, count, nbytes, size, crosses)
    for (kind, size, crosses), (count, nbytes) in sorted(
      totals.items(), key=lambda kv: (order.get(kv[0][0], len(KINDS)), -kv[1][1])
    )
  ]
