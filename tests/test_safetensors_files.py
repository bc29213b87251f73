"""`trainers.hf.safetensors_files` on the files users have: a tensor over 2 GiB, a 0-d tensor.

Files are checked with `safetensors.safe_open`, the reference reader, where
it can read them.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import safetensors
from etils import epath

from trainers.hf.safetensors_files import TensorFile, write_file

# An F16 embedding of a 262,145-token vocabulary at width 4096: 2,147,491,840
# bytes, just over the 2,147,479,552 that Linux moves in one read call.
BIG_SHAPE = (262_145, 4096)


def _sparse_file(path, shape, dtype: np.dtype) -> int:
  """A safetensors file of one tensor `w` whose data is a hole (zeros on read); its data offset."""
  nbytes = int(np.prod(shape)) * dtype.itemsize
  header = json.dumps({"w": {"dtype": "F16", "shape": list(shape), "data_offsets": [0, nbytes]}})
  header += " " * (-len(header) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header.encode())
    start = f.tell()
    f.truncate(start + nbytes)
  return start


@pytest.mark.slow  # reads 2 GiB (a hole in a sparse file, so no disk, but 2 GiB of RAM)
def test_a_tensor_over_two_gib_reads_whole(tmp_path):
  """Linux caps one read at 2 GiB less a page, so a single `pread` came back short."""
  path = tmp_path / "big.safetensors"
  dtype = np.dtype(np.float16)
  start = _sparse_file(path, BIG_SHAPE, dtype)
  row_bytes = BIG_SHAPE[1] * dtype.itemsize
  first = np.arange(BIG_SHAPE[1], dtype=dtype)
  last = -np.arange(BIG_SHAPE[1], dtype=dtype)
  with open(path, "r+b") as f:  # marked rows at both ends: the read must reach the very last byte
    os.pwrite(f.fileno(), first.tobytes(), start)
    os.pwrite(f.fileno(), last.tobytes(), start + (BIG_SHAPE[0] - 1) * row_bytes)
  value = TensorFile(path).read("w")
  assert value.shape == BIG_SHAPE and value.dtype == dtype
  np.testing.assert_array_equal(value[0], first)
  np.testing.assert_array_equal(value[-1], last)
  assert not np.any(value[1:-1:4099])  # a sample of the hole between them


def test_a_file_cut_short_is_an_error_naming_it(tmp_path):
  path = tmp_path / "cut.safetensors"
  write_file(path, {"w": np.ones((4, 8), np.float32)})
  os.truncate(path, os.path.getsize(path) - 4)
  with pytest.raises(ValueError, match=rf"{path}.*'w'.*ends"):
    TensorFile(path).read("w")


@pytest.mark.parametrize(
  "shape",
  [
    (2, 3, 4),  # over 2 dimensions: read as a remote file is, by rows
    (),  # 0-d: one value
  ],
)
def test_a_file_cut_short_is_an_error_naming_it_whatever_the_tensor(tmp_path, shape):
  path = tmp_path / "cut.safetensors"
  write_file(path, {"w": np.ones(shape, np.float32)})
  os.truncate(path, os.path.getsize(path) - 2)
  with pytest.raises(ValueError, match=rf"^{path}: tensor 'w' ends 2 bytes before its data does"):
    TensorFile(path).read("w")


@pytest.mark.multiprocess  # starts the GCS emulator
def test_a_file_on_cloud_storage_cut_short_is_an_error_naming_it(tmp_path, monkeypatch):
  """gs:// reads by byte ranges: a short answer must not be reshaped into another error."""
  from tests.gcs_emulator import serving

  local = tmp_path / "whole.safetensors"
  write_file(local, {"w": np.ones((4, 8), np.float32)})
  with serving(tmp_path / "gcs", monkeypatch):
    url = "gs://bucket/cut.safetensors"
    epath.Path(url).write_bytes(local.read_bytes()[:-36])  # a row of 32 bytes and 4 more
    # Whole rows, and a column slice of rows that stops inside the cut: the
    # count is the tensor's missing bytes either way.
    for index in (None, (slice(1, 3), slice(2, 5))):
      with pytest.raises(ValueError, match=rf"^{url}: tensor 'w' ends 36 bytes before its data"):
        TensorFile(url).read("w", index)


def test_a_0d_tensor_is_written_with_shape_empty(tmp_path):
  path = tmp_path / "scalar.safetensors"
  write_file(path, {"s": np.array(2.5, np.float32)})
  with safetensors.safe_open(str(path), framework="numpy") as f:
    assert f.get_slice("s").get_shape() == []
    assert f.get_tensor("s").shape == ()
  assert TensorFile(path).read("s").shape == ()
  assert float(TensorFile(path).read("s")) == 2.5
