"""Safetensors files: tensors' slices read by byte range; files written whole or a tensor at a time.

Reading parses the format's header (8 bytes of little-endian header length,
a JSON header of `{name: {dtype, shape, data_offsets}}`, then the row-major
data) and reads only the bytes a slice needs: a local file by `os.preadv`
of each row's span straight into the result (the slice's bytes, no more,
in as many calls as a span over Linux's 2 GiB a call takes), a `gs://` one through
`etils.epath` by byte ranges, with no local copy. `safetensors.safe_open`
is not used to read: its numpy reader has no bfloat16 (numpy lacks the
dtype; ml_dtypes supplies it here), its flax reader puts every slice on
JAX's default device, and it opens local files only.

`write_file` goes through `safetensors.serialize` (the format's Rust
encoder), given each array's bytes, so what `transformers` reads back is
the reference's own output; it needs every tensor at once. `write_streamed`
writes the same format a tensor at a time (the export of a model bigger
than the host's RAM): the header from the names, dtypes and shapes alone,
padded to 8 bytes as the reference pads it, then each tensor's bytes as it
comes. The library has no such writer. `tests/test_hf_weights.py` reads its
files back with `safetensors.safe_open`, the reference reader.

Example:
  >>> import tempfile, os, numpy as np, ml_dtypes
  >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
  >>> w = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
  >>> write_file(path, {"w": w})
  >>> f = TensorFile(path)
  >>> f.shape("w"), f.dtype("w")
  ((3, 4), dtype(bfloat16))
  >>> f.read("w", (slice(1, 3), slice(0, 2))).astype(np.float32).tolist()
  [[4.0, 5.0], [8.0, 9.0]]
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import safetensors
from etils import epath

# The format's dtype names and numpy's.
DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# safetensors.TensorSpec's own spelling of the same dtypes.
_SPEC_NAMES = {
  "F64": "float64",
  "F32": "float32",
  "F16": "float16",
  "BF16": "bfloat16",
  "I64": "int64",
  "I32": "int32",
  "I16": "int16",
  "I8": "int8",
  "U8": "uint8",
  "BOOL": "bool",
}
# Rows read at once when a slice cuts columns: the bytes held besides the slice itself.
_READ_CHUNK_BYTES = 16 << 20
FORMAT_METADATA = {"format": "pt"}  # transformers refuses files without it


class TensorFile:
  """One `.safetensors` file's header, and slices of its tensors read on demand."""

  def __init__(self, path: str | os.PathLike):
    self.path = epath.Path(path)
    self.local = "://" not in str(path)
    with self.path.open("rb") as f:
      (length,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(length))
    self._data_start = 8 + length
    self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
    self._entries: dict[str, dict] = header
    for name, entry in header.items():
      if entry["dtype"] not in DTYPES:
        raise ValueError(
          f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which is not read "
          f"(readable: {sorted(DTYPES)})"
        )

  def names(self) -> list[str]:
    return sorted(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entries[name]["shape"])

  def dtype(self, name: str) -> np.dtype:
    return DTYPES[self._entries[name]["dtype"]]

  def nbytes(self, name: str) -> int:
    begin, end = self._entries[name]["data_offsets"]
    return end - begin

  def _read_local(self, name, start, shape, dtype, rows, index, out) -> np.ndarray:
    fd = os.open(os.fspath(self.path), os.O_RDONLY)
    try:
      return _read_local_rows(fd, start, shape, dtype, rows, index, out)
    except EOFError as e:
      raise ValueError(f"{self.path}: tensor {name!r} {e}: the file is cut short") from None
    finally:
      os.close(fd)

  def _read_exactly(self, f, size: int, name: str) -> bytes:
    """`size` bytes from `f`; fewer (a file cut short) is an error naming the file and tensor.

    A read at the end of a file returns what is left, which reshaped would be
    an error naming neither.
    """
    at = f.tell()
    data = f.read(size)
    if len(data) < size:
      end = self._data_start + self._entries[name]["data_offsets"][1]
      raise ValueError(
        f"{self.path}: tensor {name!r} ends {end - at - len(data)} bytes before its data does: "
        "the file is cut short"
      )
    return data

  def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The tensor `name`, or its part `index` (one step-1 slice per dimension)."""
    shape, dtype = self.shape(name), self.dtype(name)
    index = _full(shape, index)
    start = self._data_start + self._entries[name]["data_offsets"][0]
    if not shape:
      with self.path.open("rb") as f:
        f.seek(start)
        return np.frombuffer(self._read_exactly(f, dtype.itemsize, name), dtype).reshape(())
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    first, rest = index[0], index[1:]
    rows = range(*first.indices(shape[0]))
    out = np.empty([len(range(*s.indices(n))) for s, n in zip(index, shape)], dtype)
    if not rows or out.size == 0:
      return out
    if self.local and len(shape) <= 2:
      return self._read_local(name, start, shape, dtype, rows, index, out)
    # Remote: whole rows when the slice keeps them whole; else a chunk of rows
    # at a time (one request each, not one per row), so a column slice never
    # holds the whole tensor.
    per_chunk = (
      len(rows)
      if out[0].size == math.prod(shape[1:])
      else max(1, _READ_CHUNK_BYTES // max(row_bytes, 1))
    )
    with self.path.open("rb") as f:
      for offset in range(0, len(rows), per_chunk):
        count = min(per_chunk, len(rows) - offset)
        f.seek(start + (rows.start + offset) * row_bytes)
        got = self._read_exactly(f, count * row_bytes, name)
        block = np.frombuffer(got, dtype).reshape((count, *shape[1:]))
        out[offset : offset + count] = block[(slice(None), *rest)]
    return out


def _read_local_rows(
  fd: int, start: int, shape: tuple, dtype: np.dtype, rows: range, index: tuple, out: np.ndarray
) -> np.ndarray:
  row_bytes = math.prod(shape[1:]) * dtype.itemsize
  if len(shape) == 1 or out.shape[1] == shape[1]:  # whole rows: one contiguous span
    _pread_into(fd, out, start + rows.start * row_bytes)
    return out
  # A column slice: each row's own span, so that neither the bytes read nor
  # the memory held exceed the slice (a memory map would count every page
  # it touches, i.e. the whole tensor, in the process's RSS).
  first = index[1].indices(shape[1])[0]
  for k, row in enumerate(rows):
    _pread_into(fd, out[k], start + row * row_bytes + first * dtype.itemsize)
  return out


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
  """Fills the C-contiguous `out` with the file's bytes from `offset`, in as many reads as it takes.

  One read call returns at most 2 GiB less a page on Linux (and any read may
  return fewer bytes than asked), so a span is read until it is whole; the
  bytes land in `out` itself, never in a second buffer as large.
  """
  view = memoryview(out.reshape(-1).view(np.uint8))
  done = 0
  while done < len(view):
    got = os.preadv(fd, [view[done:]], offset + done)
    if got == 0:
      raise EOFError(f"ends {len(view) - done} bytes before its data does")
    done += got


def _full(shape: tuple[int, ...], index: tuple[slice, ...] | None) -> tuple[slice, ...]:
  index = tuple(index) if index is not None else ()
  if len(index) > len(shape) or any(s.step not in (None, 1) for s in index):
    raise ValueError(f"{index=} must be step-1 slices, at most one per dimension of {shape=}")
  return index + (slice(None),) * (len(shape) - len(index))


def dtype_name(dtype: np.dtype) -> str:
  """The format's name of a numpy dtype ("BF16", "F32", ...).

  >>> dtype_name(np.dtype("float32"))
  'F32'
  """
  dtype = np.dtype(dtype)
  if dtype not in _NAMES:
    raise ValueError(f"{dtype=} has no safetensors name (known: {sorted(map(str, _NAMES))})")
  return _NAMES[dtype]


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
  """The bytes of a `.safetensors` file holding `tensors` (C-contiguous copies where needed)."""
  # C order, copied only where needed; `np.ascontiguousarray` would make a 0-d tensor 1-d.
  arrays = {name: np.asarray(value, order="C") for name, value in tensors.items()}
  specs = {
    name: safetensors.TensorSpec(
      dtype=_SPEC_NAMES[dtype_name(a.dtype)],
      shape=list(a.shape),
      data_ptr=a.ctypes.data,
      data_len=a.nbytes,
    )
    for name, a in arrays.items()
  }
  # `arrays` keeps every buffer alive while the encoder reads the pointers.
  data = safetensors.serialize(specs, metadata={**FORMAT_METADATA, **(metadata or {})})
  del arrays
  return bytes(data)


def write_file(
  path: str | os.PathLike,
  tensors: Mapping[str, np.ndarray],
  metadata: Mapping[str, str] | None = None,
) -> None:
  """Writes `tensors` as one `.safetensors` file, locally or on any `etils.epath` URL."""
  epath.Path(path).write_bytes(encode(tensors, metadata))


def write_streamed(
  path: str | os.PathLike,
  entries: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
  tensors: Iterator[np.ndarray],
  metadata: Mapping[str, str] | None = None,
) -> None:
  """Writes one `.safetensors` file of `entries` (name, dtype, shape), taking each from `tensors`.

  The header is known from the entries alone, so each tensor is written as it
  comes and only one is held at a time (`encode` needs them all at once: the
  reference encoder takes every buffer in one call). The data follow the
  entries' order; readers find each by its offsets, as the format has it.
  A tensor whose dtype or shape is not its entry's is an error naming it.
  """
  header: dict[str, Any] = {"__metadata__": {**FORMAT_METADATA, **(metadata or {})}}
  offset = 0
  for name, dtype, shape in entries:
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    header[name] = {
      "dtype": dtype_name(dtype),
      "shape": list(shape),
      "data_offsets": [offset, offset + nbytes],
    }
    offset += nbytes
  encoded = json.dumps(header, separators=(",", ":")).encode()
  encoded += b" " * (-len(encoded) % 8)  # the reference pads the header to 8 bytes
  with epath.Path(path).open("wb") as f:
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for name, dtype, shape in entries:
      value = next(tensors)
      if value.dtype != np.dtype(dtype) or tuple(value.shape) != tuple(shape):
        raise ValueError(
          f"{name}: got {value.dtype}{list(value.shape)}, its entry says {np.dtype(dtype)}{list(shape)}"
        )
      f.write(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
