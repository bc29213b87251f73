"""One process of a group that prepares a `data.sources` source (tests/test_source_shards.py).

Usage: prepare_worker.py SOURCE DATA_DIR OUT_DIR [options as key=value]
Options: seq_len, vocab_size, shard_bytes, text_piece (bytes of a .txt read at a time).

Prepares the source's train split as spmd-train does with a local data.dir
(every process its share, `trainers.data.prepare.source_shards`), and writes
OUT_DIR/p<N>.json: the dataset's name, and this process's peak memory
while preparing over its memory before (`VmHWM` after the kernel's peak is
reset through /proc/self/clear_refs, minus `VmRSS`).
"""

import json
import pathlib
import sys

import spmd

spmd.initialize()

import jax  # noqa: E402

from spmd import multihost  # noqa: E402
from trainers.data.prepare import documents, source_packed, source_shards  # noqa: E402
from trainers.data.prepare.prepare_group import PrepareGroup  # noqa: E402
from trainers.data.prepare.source_files import SourceSpec, list_source  # noqa: E402

source_spec, data_dir, out_dir = sys.argv[1:4]
opts = dict(a.split("=", 1) for a in sys.argv[4:])
source_shards.SHARD_BYTES = int(opts.get("shard_bytes", source_shards.SHARD_BYTES))
documents.TEXT_PIECE = int(opts.get("text_piece", documents.TEXT_PIECE))


def status_kib(field: str) -> int:
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1])
  raise KeyError(field)


config = source_packed.source_config(
  list_source(SourceSpec(source_spec)),
  split="train",
  validation_percent=0.0,
  seq_len=int(opts.get("seq_len", 64)),
  vocab_size=int(opts.get("vocab_size", 256)),
)
group = PrepareGroup(jax.process_index(), jax.process_count(), multihost.barrier)
pathlib.Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
before = status_kib("VmRSS")
prepared = source_packed.prepare_source(data_dir, config, group)
facts = {"name": prepared.name, "peak_growth_kib": status_kib("VmHWM") - before}
(pathlib.Path(out_dir) / f"p{jax.process_index()}.json").write_text(json.dumps(facts))
