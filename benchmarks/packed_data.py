"""What preparing packed LM data costs on the embedded corpus (this Python's stdlib).

  python -m benchmarks.packed_data [--data-dir=workdir/bench/packed_data] [--vocab 1024 2048]
      [--seq-len 64 128]

For each vocabulary: the BPE's training time (first use, then cached); for each
vocabulary and seq_len: the packing time (tokenize, frame, window, write) and
the packed dataset's size on disk, with its windows and tokens per byte of text.
Each measurement starts from an empty cache for what it times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

from absl import logging as absl_logging

from trainers.data.prepare import packed, text_corpus
from trainers.data.prepare import tokenizer as tok


def du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data-dir", default="workdir/bench/packed_data")
  parser.add_argument("--vocab", type=int, nargs="+", default=[1024, 2048])
  parser.add_argument("--seq-len", type=int, nargs="+", default=[64, 128])
  args = parser.parse_args()
  absl_logging.set_verbosity(absl_logging.ERROR)
  data_dir = os.path.abspath(args.data_dir)
  shutil.rmtree(data_dir, ignore_errors=True)
  files = text_corpus.corpus_files(None, exclude=data_dir)
  train = [f.path for f in text_corpus.split_files(files)[text_corpus.TRAIN]]
  text_bytes = sum(os.path.getsize(p) for p in train)
  key = text_corpus.text_corpus_config(None, exclude=data_dir).name
  rows = []
  for vocab in args.vocab:
    started = time.perf_counter()
    tokenizer = tok.bpe_tokenizer(data_dir, key, train, vocab)
    trained = time.perf_counter() - started
    for seq_len in args.seq_len:
      config = packed.packed_config(
        seq_len=seq_len, seed=0, vocab_size=vocab, tokenizer=tokenizer, exclude=data_dir
      )
      started = time.perf_counter()
      name = packed.prepare_packed(data_dir, config)
      packing = time.perf_counter() - started
      where = os.path.join(data_dir, packed.NAME, config.name)
      from trainers.data.records.datasets import open_source

      records = open_source(name, "train", data_dir)
      plan = packed.packed_plan(seq_len)(records)
      rows.append(
        {
          "vocab": vocab,
          "seq_len": seq_len,
          "bpe_train_s": round(trained, 1),
          "pack_s": round(packing, 1),
          "disk_mb": round(du(where) / 2**20, 1),
          "train_records": len(records),
          "train_windows": plan.examples,
          "train_tokens": plan.total,
          "text_bytes_per_token": round(text_bytes / plan.total, 2),
        }
      )
      print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
  main()
