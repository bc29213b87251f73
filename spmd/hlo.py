"""The collectives of a compiled program, read from its optimised HLO.

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

The same module's matmul FLOPs, dots and their dtypes (`matmul_flops`, `dots`,
`matmul_flops_by_dtype`) are read by
`spmd.hlo_matmuls` and offered here too, so that `spmd.hlo` stays the one
place to read a compiled program from; `spmd.hlo_text` holds the reading
both share (computations, loop trip counts, array sizes).

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
from collections.abc import Sequence

import numpy as np

from spmd.hlo_matmuls import Dot, dots, matmul_flops, matmul_flops_by_dtype
from spmd.hlo_text import array_bytes, executed_computations

__all__ = [
  "KINDS",
  "Collective",
  "CollectiveOp",
  "Dot",
  "collective_ops",
  "collectives",
  "dots",
  "matmul_flops",
  "matmul_flops_by_dtype",
  "parse_groups",
]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_INSTRUCTION = re.compile(
  r"=\s*(?P<shape>.+?)\s(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
# Multislice TPU programs hand the DCN part of a collective to the megascale
# runtime as a host-transfer `send`, tagged with the collective's kind.
_MEGASCALE_SEND = re.compile(
  r"=\s*(?P<shape>.+?)\ssend\(.*_xla_megascale_transfer_type=\"(?P<kind>\w+)\""
)


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective kind over one kind of group, summed over a step."""

  kind: str
  count: int  # executions per step
  bytes: int  # result bytes per device, summed over the executions
  group_size: int  # devices per group (0: not known)
  crosses_dcn: bool | None  # a group spans slices; None: groups not known


def _result_bytes(shape_text: str, is_async: bool) -> int:
  sizes = array_bytes(shape_text)
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
    # `replica_groups={}`: XLA's spelling of one group of every device.
    return groups
  if text.startswith("mesh["):
    return _mesh_groups(text)
  return _iota_groups(text)


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective instruction of a compiled program, as `collective_ops` reads it."""

  kind: str
  computation: str  # the HLO computation holding it (a loop body, a fusion, the entry)
  executions: int  # per call of the entry: loop trip counts multiplied in
  bytes: int  # result bytes per device, one execution
  groups: (
    list[list[int]] | None
  )  # partition ids of each group; []: one of every device; None: not known
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
  ops = []
  for name, times, lines in executed_computations(hlo_text):
    for line in lines:
      dcn = _MEGASCALE_SEND.search(line)
      if dcn:
        kind = dcn.group("kind").lower().replace("_", "-")
        nbytes = (array_bytes(dcn.group("shape")) or [0])[0]
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
      crosses, groups = None, op.groups
      if groups == [] and device_slices is not None:  # one group of every device
        groups = [list(range(len(device_slices)))]
      if device_slices is not None and len(set(device_slices)) == 1:
        crosses = False  # one slice: nothing to cross, whatever the groups
      elif groups and device_slices is not None:
        crosses = any(len({device_slices[i] for i in g}) > 1 for g in groups)
      key = (op.kind, len(groups[0]) if groups else 0, crosses)
    count, total = totals.get(key, [0, 0])
    totals[key] = [count + op.executions, total + op.executions * op.bytes]
  order = {kind: i for i, kind in enumerate(KINDS)}
  return [
    Collective(kind, count, nbytes, size, crosses)
    for (kind, size, crosses), (count, nbytes) in sorted(
      totals.items(), key=lambda kv: (order.get(kv[0][0], len(KINDS)), -kv[1][1])
    )
  ]
