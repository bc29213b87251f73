"""`spmd-train` whose prepared `data.sources` datasets have small records and shards.

SPMD_TEST_RECORD_TOKENS tokens a record and SPMD_TEST_SHARD_BYTES a shard:
a dataset of many shards of many records from a corpus a test can afford,
so that a bounded cache of staged shards must evict
(tests/test_staged_data.py). It sets both in this process, then runs the
real entry point.
"""

import os

from trainers.data.prepare import packed, source_shards
from trainers.run import train_cli

source_shards.SHARD_BYTES = int(os.environ["SPMD_TEST_SHARD_BYTES"])
packed.RECORD_TOKENS = int(os.environ["SPMD_TEST_RECORD_TOKENS"])

if __name__ == "__main__":
  raise SystemExit(train_cli.main())
