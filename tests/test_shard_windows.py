"""The shard-window record order and the cache of staged shards it is for.

`record_order.ShardWindows`: every record exactly once an epoch, a few
shards at a time, the same on any process count, and a digest of its own.
`shard_cache.ShardCache`: shards copied when first read, least recently used
removed to stay within its bytes, and nothing removed that it did not write.
"""

from __future__ import annotations

import pathlib
import re
import shutil

import numpy as np
import pytest
from array_record.python import array_record_module
from etils import epath

from spmd.errors import UserError
from tests.data_fixtures import source_texts, write_jsonl
from trainers.data.prepare import source_packed, source_shards
from trainers.data.prepare.holdout import TRAIN
from trainers.data.prepare.source_files import SourceSpec, list_source
from trainers.data.records.datasets import Staging, open_source
from trainers.data.records.record_order import ShardWindows, order_digest, record_in_order
from trainers.data.records.shard_cache import ShardCache


def _epoch(sizes, window, seed, epoch, short_last=False):
  count = sum(sizes)
  windows = ShardWindows(tuple(sizes), window)
  return [
    record_in_order(epoch * count + p, count, seed, short_last, windows) for p in range(count)
  ]


@pytest.mark.parametrize("sizes", [(5, 0, 7, 3, 9, 1), (4,), (2, 2, 2, 2, 2, 2, 2, 2), (0, 6, 0)])
@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("short_last", [False, True])
def test_each_record_comes_once_an_epoch_and_a_window_of_shards_at_a_time(
  sizes, window, short_last
):
  firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  shard_of = np.repeat(np.arange(len(sizes)), sizes)
  for epoch in range(3):
    order = _epoch(sizes, window, seed=7, epoch=epoch, short_last=short_last)
    assert sorted(order) == list(range(sum(sizes))), order
    if short_last:
      assert order[-1] == sum(sizes) - 1
    # From a shard's first record to its last, only its window's shards are read.
    shards = shard_of[order[: len(order) - short_last]]
    for shard in set(shards.tolist()):
      where = np.flatnonzero(shards == shard)
      between = set(shards[where[0] : where[-1] + 1].tolist())
      assert len(between) <= window, (epoch, shard, between)
  assert firsts[-1] == sum(sizes[:-1])


def test_epochs_and_seeds_reorder_and_the_digest_names_the_order():
  sizes = (10, 10, 10, 10)
  assert _epoch(sizes, 2, seed=0, epoch=0) != _epoch(sizes, 2, seed=0, epoch=1)
  assert _epoch(sizes, 2, seed=0, epoch=0) != _epoch(sizes, 2, seed=1, epoch=0)
  plain = order_digest(40, 1, 256, seed=0)
  two = order_digest(40, 1, 256, seed=0, shard_windows=ShardWindows(sizes, 2))
  one = order_digest(40, 1, 256, seed=0, shard_windows=ShardWindows(sizes, 1))
  assert len({plain, two, one}) == 3
  with pytest.raises(ValueError, match="sum to 40, not the 41 records"):
    record_in_order(0, 41, 0, False, ShardWindows(sizes, 2))


def _shards(folder: epath.Path, count: int) -> list[str]:
  folder.mkdir(parents=True, exist_ok=True)
  urls = []
  for k in range(count):
    path = folder / f"shard-{k:05d}"
    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    for r in range(3):
      writer.write(f"{k}:{r}".encode())
    writer.close()
    urls.append(str(path))
  return urls


def test_the_cache_stages_on_demand_within_its_bytes_and_removes_only_its_own(tmp_path):
  urls = _shards(epath.Path(tmp_path / "remote"), 5)
  size = epath.Path(urls[0]).stat().length
  local = tmp_path / "local"
  local.mkdir()
  (local / "notes.txt").write_text("a user's file")  # not the cache's: never removed
  cache = ShardCache(local, capacity=2 * size + size // 2)
  for k in [0, 1, 0, 2, 3, 0, 4, 1]:
    assert cache.read(urls[k], [2, 0]) == [f"{k}:2".encode(), f"{k}:0".encode()]
    assert cache.used <= cache.capacity
    held = list(cache.folder.glob("*-shard-*"))
    assert sum(p.stat().length for p in held) <= cache.capacity, held
  assert cache.staged == 7  # 0 stayed while used; 1 came back after its eviction
  cache.close()
  again = ShardCache(local, capacity=2 * size)  # the next run: the closed cache's copies go
  assert sorted(p.name for p in local.iterdir()) == [again.folder.name, "notes.txt"]
  assert not list(again.folder.iterdir())[1:], list(again.folder.iterdir())  # its lock alone
  with pytest.raises(ValueError, match=r"data.cache_bytes=10 cannot hold shard .*shard-00000"):
    ShardCache(tmp_path / "tiny", capacity=10).read(urls[0], [0])
  again.close()


def test_two_caches_on_one_folder_keep_apart_each_within_its_bytes(tmp_path):
  """Two runs on one host reading one gs:// data.dir (training, and an eval beside it) make
  their caches in the same staged folder (`staged/<hash>/process-<i>`). The second must not
  remove the first's copies: the first goes on reading and evicting, and each run's copies stay
  within its own bytes."""
  urls = _shards(epath.Path(tmp_path / "remote"), 6)
  size = epath.Path(urls[0]).stat().length
  local = tmp_path / "staged" / "process-0"
  first = ShardCache(local, capacity=2 * size)
  assert first.read(urls[0], [1]) == [b"0:1"] and first.read(urls[1], [1]) == [b"1:1"]
  second = ShardCache(local, capacity=2 * size)
  for cache, shards in ((second, [2, 3, 4]), (first, [2, 0, 5]), (second, [0, 1])):
    for k in shards:
      assert cache.read(urls[k], [0]) == [f"{k}:0".encode()]
      for each in (first, second):
        held = [p for p in pathlib.Path(each.folder).rglob("*") if p.is_file()]
        held = [p for p in held if not p.name.startswith(".")]  # its lock, a partial copy
        assert sum(p.stat().st_size for p in held) == each.used <= each.capacity, held
  first.close()
  second.close()


def test_a_cache_smaller_than_two_shards_is_a_user_error_naming_the_dataset_and_the_size(
  tmp_path, monkeypatch
):
  """A mixture's two sources staged through a `data.cache_bytes` too small: one line (exit 2,
  not a traceback that `--max-restarts` retries) naming the setting, the source's dataset with
  its config (the sources' datasets differ only there) and the bytes it needs."""
  monkeypatch.setattr(source_shards, "SHARD_BYTES", 2 * (4 * 16 + 1) * 2)  # 2 records a shard
  remote, local = tmp_path / "remote", tmp_path / "local"
  names = []
  for which in ("a", "b"):
    spec = write_jsonl(tmp_path / which, source_texts(80, seed=len(names)), files=2)
    config = source_packed.source_config(
      list_source(SourceSpec(spec)),
      split=TRAIN,
      validation_percent=0.0,
      seq_len=16,
      vocab_size=256,
      run_windows=4,
    )
    names.append(source_packed.prepare_source(remote, config).name)
  shutil.copytree(remote, local, ignore=shutil.ignore_patterns("*.array_record-*"))
  cache = ShardCache(tmp_path / "staged", capacity=1000)
  staging = Staging(remote=str(remote), local=str(local), cache=cache, share=2)
  for name in names:
    with pytest.raises(UserError) as raised:
      open_source(name, TRAIN, local, ["tokens"], staging)
    message = str(raised.value)
    assert "data.cache_bytes=1000" in message and "\n" not in message, message
    config = name.split("/")[1].split(":")[0]
    assert config in message, message
    assert re.search(r"raise it to at least \d+", message), message
  cache.close()
