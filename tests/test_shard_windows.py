"""The shard-window record order and the cache of staged shards it is for.

`record_order.ShardWindows`: every record exactly once an epoch, a few
shards at a time, the same on any process count, and a digest of its own.
`shard_cache.ShardCache`: shards copied when first read, least recently used
removed to stay within its bytes, and nothing removed that it did not write.
"""

from __future__ import annotations

import numpy as np
import pytest
from array_record.python import array_record_module
from etils import epath

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
    held = [p for p in local.iterdir() if p.name != "notes.txt"]
    assert sum(p.stat().st_size for p in held) <= cache.capacity, held
  assert cache.staged == 7  # 0 stayed while used; 1 came back after its eviction
  cache.close()
  again = ShardCache(local, capacity=2 * size)  # the next run: the old copies are its own
  assert sorted(p.name for p in local.iterdir()) == ["notes.txt"]
  with pytest.raises(ValueError, match=r"data.cache_bytes=10 cannot hold shard .*shard-00000"):
    ShardCache(tmp_path / "tiny", capacity=10).read(urls[0], [0])
  again.close()
