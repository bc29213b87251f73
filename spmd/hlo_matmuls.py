"""The matmul FLOPs and dots of a compiled program, read from its optimised HLO.

`matmul_flops` counts the dots and convolutions once per execution, loop
trip counts included, which XLA's cost analysis does not do for loop
bodies; `dots` lists the dots themselves, as `jax.lax.dot_general` would
take them, to replay a step's matmuls alone; `matmul_flops_by_dtype` says
what the dots and convolutions multiply (their operands' dtypes).

Example:
  >>> text = '''ENTRY %main (a: f32[8,32], b: f32[32,16]) -> f32[8,16] {
  ...   %a = f32[8,32]{1,0} parameter(0)
  ...   %b = f32[32,16]{1,0} parameter(1)
  ...   ROOT %d = f32[8,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ... }'''
  >>> matmul_flops(text), [d.lhs for d in dots(text)]
  (8192.0, [(8, 32)])
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

import numpy as np

from spmd.hlo_text import ARRAY, executed_computations, parse_dims

_NUMPY_DTYPES = {
  "pred": "bool",
  "bf16": "bfloat16",
  **{
    f"{k}{n}": f"{v}{n}"
    for k, v in (("f", "float"), ("s", "int"), ("u", "uint"))
    for n in (8, 16, 32, 64)
  },
}
_NAMED_ARRAY = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[a-z]+\d*[a-z0-9]*\[([\d,]*)\]")
_MATMUL = re.compile(
  r"=\s*[a-z]+\d*[a-z0-9]*\[(?P<out>[\d,]*)\]\S*\s(?P<op>dot|convolution)\((?P<args>[^)]*)\)"
)
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _operand_dims(args: str, shapes: dict[str, list[int]]) -> list[list[int] | None]:
  """Each operand's dimensions: printed inline (`f32[8,4]{1,0} %a`) or looked up by name."""
  found = []
  for arg in args.split(", "):
    inline = ARRAY.search(arg)
    name = arg.split()[-1].lstrip("%") if arg.split() else ""
    found.append(parse_dims(inline.group(2)) if inline else shapes.get(name))
  return found


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
  for _, times, lines in executed_computations(hlo_text):
    shapes = {m.group(1): parse_dims(m.group(2)) for m in map(_NAMED_ARRAY.match, lines) if m}
    for line in lines:
      m = _MATMUL.search(line)
      if not m:
        continue
      lhs, rhs = [*_operand_dims(m.group("args"), shapes), None, None][:2]
      if lhs is not None and rhs is not None:
        yield times, line, m, parse_dims(m.group("out")), lhs, rhs


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
  return sum(times * _flops(*rest) for times, *rest in _matmuls(hlo_text))


def _flops(line: str, m: re.Match, out: list[int], lhs: list[int], rhs: list[int]) -> float:
  """One execution's FLOPs of a dot or convolution."""
  if m.group("op") == "dot":
    contracting = _CONTRACTING.search(line)
    inner = math.prod(lhs[i] for i in parse_dims(contracting.group(1))) if contracting else 1
    return float(2 * math.prod(out) * inner)
  return float(_convolution_flops(line, out, lhs, rhs))


_TYPED_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z]+\d*[a-z0-9]*)\[", re.M)


def _operand_dtypes(args: str, types: dict[str, str]) -> tuple[str, ...]:
  """Each operand's dtype, as numpy names it: printed inline or looked up by name."""
  found = []
  for arg in args.split(", ")[:2]:
    inline = ARRAY.search(arg)
    name = arg.split()[-1].lstrip("%") if arg.split() else ""
    hlo_dtype = inline.group(1) if inline else types.get(name, "unknown")
    found.append(_NUMPY_DTYPES.get(hlo_dtype, hlo_dtype))
  return tuple(found)


def matmul_flops_by_dtype(hlo_text: str) -> dict[tuple[str, ...], float]:
  """`matmul_flops` split by the dtypes of each dot's or convolution's operands (numpy names).

  What the program multiplies in: a bfloat16 weight against a float32 input
  is a float32 product of a widened weight, and a compiler may widen
  bfloat16 products itself (XLA:CPU does), so the operands, not the
  parameters, tell.

  Example:
    >>> text = '''ENTRY %main (a: bf16[8,32], b: bf16[32,16]) -> f32[8,16] {
    ...   %a = bf16[8,32]{1,0} parameter(0)
    ...   %b = bf16[32,16]{1,0} parameter(1)
    ...   ROOT %d = f32[8,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }'''
    >>> matmul_flops_by_dtype(text)
    {('bfloat16', 'bfloat16'): 8192.0}
  """
  types = dict(_TYPED_NAME.findall(hlo_text))
  found: dict[tuple[str, ...], float] = {}
  for times, line, m, out, lhs, rhs in _matmuls(hlo_text):
    key = _operand_dtypes(m.group("args"), types)
    found[key] = found.get(key, 0.0) + times * _flops(line, m, out, lhs, rhs)
  return found


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
  return tuple(parse_dims(match.group(1))) if match else ()


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
