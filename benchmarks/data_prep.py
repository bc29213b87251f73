"""D1-D3: `data.sources` prepared by 4 processes, and the first step after, as the corpus grows 4x.

  python -m benchmarks.data_prep [--out=workdir/bench/data_prep] [--json=out.json]
      [--files=16] [--rounds=2]

The corpus is generated here: JSONL files of word salad whose sizes vary
(from 1/2 to 2 times the mean), N files for 1x and 4N of the same sizes for
4x, and one file of short documents (a few words each, as titles are),
itself 4 times larger in the 4x corpus: 4x the data is then also 4x the
documents of one file, which packing must neither hold nor pass over for
each record. Each is prepared as `spmd-train` prepares
`config.data.sources` with a local `data.dir` (`configs/llama_tiny.py` on
bytes), by 4 processes of `spmd-launch local`, each its share
(`trainers.data.prepare.source_shards`):

  D1  the largest share of the train split's tokens that one of the 4
      processes tokenized (the ideal is 1/4; goal <= 0.3);
  D2  peak RSS of a preparing process (the largest of the 4; the kernel's
      peak reset when preparation starts) with the 4x corpus ÷ with the 1x
      (goal <= 1.15: memory does not follow the corpus, nor a file's
      documents); the detail gives the seconds each preparation took;
  D3  seconds from starting `spmd-train` on 4 processes to its first step,
      on the 4x dataset prepared ÷ on the 1x (goal <= 1.2: a larger
      dataset is opened, not read). A first, untimed run fills the
      compilation cache; the two timed runs alternate over `--rounds`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import time

import numpy as np

from benchmarks import common
from benchmarks.launches import run_training

CONFIG = "configs/llama_tiny.py"
PROCESSES = 4
FILES = 16  # of the 1x corpus
MEAN_FILE_BYTES = 1 << 20
SHORT_FILE_BYTES = 4 * MEAN_FILE_BYTES  # the 1x corpus's file of short documents
SETTINGS = ["--config.data.tokenizer=bytes", "--config.model.vocab_size=256"]
WORDS = tuple("the of and to in is was for on that with by as at from his her it an".split())


def write_corpus(folder: pathlib.Path, files: int, short_bytes: int, seed: int = 0) -> str:
  """`files` JSONL files of documents of 20-400 words, sizes from 1/2 to 2x the mean, and one of
  `short_bytes` of documents of 1-8 words; their glob."""
  rng = np.random.default_rng(seed)
  folder.mkdir(parents=True, exist_ok=True)
  for f in range(files):
    target = int(MEAN_FILE_BYTES * 2 ** rng.uniform(-1, 1))
    _write_jsonl(folder / f"part-{f:04d}.jsonl", target, rng, 20, 400)
  _write_jsonl(folder / "short.jsonl", short_bytes, rng, 1, 8)
  return str(folder / "*.jsonl")


def _write_jsonl(path: pathlib.Path, size: int, rng: np.random.Generator, low: int, high: int):
  """About `size` bytes of JSONL rows, each a document of `low` to `high` words."""
  lines, written = [], 0
  while written < size:
    words = rng.choice(WORDS, size=int(rng.integers(low, high)))
    line = json.dumps({"text": " ".join(words)}) + "\n"
    lines.append(line)
    written += len(line)
  path.write_text("".join(lines))


def _status_kib(field: str) -> int:
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1])
  raise KeyError(field)


def worker(sources: str, data_dir: str, out: str) -> None:
  """One of the preparing processes: what `spmd-train`'s LM task prepares, with its config."""
  import spmd

  spmd.initialize()
  import jax

  from spmd import multihost
  from trainers.data.prepare import source_packed
  from trainers.data.prepare.holdout import TRAIN, VALIDATION
  from trainers.data.prepare.prepare_group import PrepareGroup
  from trainers.data.prepare.source_files import list_sources, parse_sources

  config = common.load_config(CONFIG)
  config.data.tokenizer, config.model.vocab_size = "bytes", 256
  group = PrepareGroup(jax.process_index(), jax.process_count(), multihost.barrier)
  (source,) = list_sources(parse_sources(sources))
  percent = float(config.data.validation_percent)

  def split(which: str):
    built = source_packed.source_config(
      source,
      split=which,
      validation_percent=percent,
      seq_len=config.model.seq_len,
      vocab_size=config.model.vocab_size,
      text_field=config.data.text_field,
      skip_bad_rows=int(config.data.skip_bad_rows),
    )
    return source_packed.prepare_source(data_dir, built, group)

  pathlib.Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
  before = _status_kib("VmRSS")
  train = split(TRAIN)
  if train.other_split:
    split(VALIDATION)  # as spmd-train does: the held-out documents are their own dataset
  facts = {
    "tokenized": train.tokenized_here,
    "peak_kib": _status_kib("VmHWM"),
    "growth_kib": _status_kib("VmHWM") - before,
  }
  pathlib.Path(out, f"p{jax.process_index()}.json").write_text(json.dumps(facts))


def prepare(root: pathlib.Path, sources: str, data_dir: pathlib.Path) -> list[dict]:
  """The facts of each of the 4 processes that prepared `sources` into `data_dir`."""
  from launch.local import run_local

  out = root / f"facts-{data_dir.name}"
  shutil.rmtree(out, ignore_errors=True)
  shutil.rmtree(data_dir, ignore_errors=True)
  out.mkdir(parents=True)
  here = str(pathlib.Path(__file__).resolve().parent.parent)
  result = run_local(
    [sys.executable, "-m", "benchmarks.data_prep", "--worker", sources, str(data_dir), str(out)],
    num_processes=PROCESSES,
    timeout_s=900,
    echo=False,
    cwd=here,
    env={"PYTHONPATH": here},
  )
  if not result.ok:
    raise RuntimeError(result.report())
  return [json.loads((out / f"p{p}.json").read_text()) for p in range(PROCESSES)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="workdir/bench/data_prep")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--files", type=int, default=FILES, help="of the 1x corpus")
  parser.add_argument("--json")
  parser.add_argument("--worker", nargs=3, metavar=("SOURCES", "DATA_DIR", "OUT"))
  args = parser.parse_args()
  if args.worker:
    worker(*args.worker)
    return
  root = pathlib.Path(args.out).resolve()
  shutil.rmtree(root, ignore_errors=True)
  corpora = {
    n: write_corpus(root / f"corpus{n}", n * args.files, n * SHORT_FILE_BYTES) for n in (1, 4)
  }
  facts, prepared_s = {}, {}
  for n in (1, 4):
    started = time.monotonic()
    facts[n] = prepare(root, corpora[n], root / f"data{n}")
    prepared_s[n] = time.monotonic() - started
  tokens = {n: sum(p["tokenized"] for p in facts[n]) for n in (1, 4)}
  d1 = max(p["tokenized"] for p in facts[4]) / tokens[4]
  peak = {n: max(p["peak_kib"] for p in facts[n]) for n in (1, 4)}
  growth = {n: max(p["growth_kib"] for p in facts[n]) for n in (1, 4)}

  cache = root / "compilation_cache"

  def first_step_s(n: int, name: str) -> float:
    overrides = [
      *SETTINGS,
      f"--config.data.sources={corpora[n]}",
      f"--config.data.dir={root / f'data{n}'}",
      f"--config.compilation_cache_dir={cache}",
      "--config.train.steps=1",
      "--config.eval_every=0",
      "--config.sample_tokens=0",
      "--config.checkpoint.every=100000",
    ]
    summary, started = run_training(str(root / name), CONFIG, PROCESSES, 1, overrides)
    return summary["first_step_at"] - started

  first_step_s(1, "warm")  # fills the compilation cache
  times: dict[int, list[float]] = {1: [], 4: []}
  for i in range(args.rounds):
    for n in (1, 4) if i % 2 == 0 else (4, 1):
      times[n].append(first_step_s(n, f"run{n}"))
  d3 = statistics.median(times[4]) / statistics.median(times[1])

  mib = 1024
  machine = common.machine(f"{PROCESSES} processes x 1 CPU device")
  common.emit(
    [
      common.row(
        "D1",
        f"largest share of the corpus's tokens tokenized by one of {PROCESSES} preparing processes",
        d1,
        0.3,
        True,
        f"{4 * args.files + 1} JSONL files, {tokens[4] / 1e6:.1f}M tokens (bytes); shares "
        + ", ".join(f"{p['tokenized'] / tokens[4]:.3f}" for p in facts[4]),
        machine,
      ),
      common.row(
        "D2",
        "peak RSS of a preparing process, corpus 4x larger ÷ 1x",
        peak[4] / peak[1],
        1.15,
        True,
        f"{tokens[1] / 1e6:.1f}M vs {tokens[4] / 1e6:.1f}M tokens on {PROCESSES} processes, "
        f"a file of {SHORT_FILE_BYTES >> 20} vs {4 * SHORT_FILE_BYTES >> 20} MiB of short "
        f"documents among them: {peak[1] / mib:.0f} vs {peak[4] / mib:.0f} MiB, of which "
        f"preparing added {growth[1] / mib:.1f} vs {growth[4] / mib:.1f} MiB; prepared in "
        f"{prepared_s[1]:.0f} vs {prepared_s[4]:.0f} s",
        machine,
      ),
      common.row(
        "D3",
        f"seconds to the first step of `spmd-train` on {PROCESSES} processes, dataset 4x ÷ 1x",
        d3,
        1.2,
        True,
        f"{os.path.basename(CONFIG)} on bytes, prepared: "
        f"{statistics.median(times[1]):.1f} vs {statistics.median(times[4]):.1f} s "
        f"(medians of {args.rounds})",
        machine,
      ),
    ],
    args.json,
  )


if __name__ == "__main__":
  main()
