"""The record format: a prepared split on disk, as both rooms of the data path see it.

  plan.py            what a split's records hold (`RecordPlan`) and their lengths
  stored_lengths.py  each split's record lengths kept beside its index, so no
                     host reads every record at startup
  datasets.py        `open_source`: any prepared TFDS dataset as a random-access
                     source, its shards checked; `Staging`: a remote one's shards
                     read through the cache
  shard_cache.py     a remote dataset's shards staged on demand into a bounded cache
  record_order.py    the seeded order of a split's records (epochs, shard windows)

`trainers.data.prepare` writes it and `trainers.data.read` reads it; this
package imports neither (tests/test_layers.py holds this). The staged
shards and their order sit here, not in `read/`, because `open_source`
builds a staged split from them. Nothing is imported here.
"""
