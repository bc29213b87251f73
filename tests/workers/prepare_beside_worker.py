"""One run preparing a `data.sources` source alone, beside another run on the same data.dir.

Usage: prepare_beside_worker.py SOURCE DATA_DIR GO_FILE SHARD_BYTES

(tests/test_source_shards.py). Prepares the source's train split as a
one-process `spmd-train` does, starting once GO_FILE exists, so that two
runs started side by side prepare at the same moment, as a sweep's runs
do. Prints the dataset's name.
"""

import pathlib
import sys
import time

from trainers.data.prepare import source_packed, source_shards
from trainers.data.prepare.source_files import SourceSpec, list_source

source_spec, data_dir, go, shard_bytes = sys.argv[1:5]
source_shards.SHARD_BYTES = int(shard_bytes)  # many shards: many files both runs write
config = source_packed.source_config(
  list_source(SourceSpec(source_spec)),
  split="train",
  validation_percent=0.0,
  seq_len=16,
  vocab_size=256,
  run_windows=4,
)
while not pathlib.Path(go).exists():
  time.sleep(0.01)
print(source_packed.prepare_source(data_dir, config).name)
