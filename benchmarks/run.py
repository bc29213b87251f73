"""`make bench`: every performance figure (P1-P8, P10, M1, M2) in one run, as JSON and Markdown.

  python -m benchmarks.run [--only=P4,P5] [--out=workdir/bench] [--update-readme]

Each benchmark runs in a process of its own (they need different device
counts and process layouts):

  P1      benchmarks/trainer.py     trainer vs hand-written step (4 CPU devices)
  P3      benchmarks/trainer.py     FLOP/s vs matmul peak (1 CPU device: the
                                    machine as JAX sees it by default, not
                                    split into devices that share its cores)
  P2      benchmarks/dispatch.py    sharded_jit vs jax.jit dispatch
  P4, P5  benchmarks/training.py    input pipeline and async checkpoint costs
  P6, P8  benchmarks/launches.py    2 processes vs 1; warm vs cold compilation cache
  P7      benchmarks/memory.py      FSDP bytes per device from the compiled program
  P10     benchmarks/llama.py       our Llama step vs a hand-written plain-JAX Llama
                                    step at MaxText's small shape (1 CPU device),
                                    and its model FLOP/s
  M1      benchmarks/pod_memory.py  Llama-3-8B's bytes per device on v5p-256 (pure
                                    FSDP, compiled through libtpu) vs MaxText's;
                                    M1-xla the same with XLA's attention
  M2      benchmarks/pod_flops.py   compiled FLOPs per device of llama3_8b on v5p-256
                                    (libtpu), fsdp_tp vs pure FSDP: nothing timed

Every module runs with TCMalloc preloaded where this machine has it, as
`spmd-launch` runs the trainer (`launch/allocator.py`); each row's machine
says which allocator it had.

The rows go to `OUT/results.json` and `OUT/results.md`. `--update-readme`
also writes them to `benchmarks/latest.json` and into the same table in the
README and in docs/performance.md (between their `bench:start`/`bench:end`
markers), so both always show the latest figures; a test checks that they
agree with `latest.json`. With `--only`, only those figures are replaced
(each row keeps its own date).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from benchmarks import common
from launch import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (module, figures it reports here, environment it runs with)
BENCHMARKS = [
  ("trainer", ("P1",), {"BENCH_DEVICES": "4"}),
  ("trainer", ("P3",), {"BENCH_DEVICES": "1"}),
  ("dispatch", ("P2",), {}),
  ("training", ("P4", "P5"), {}),
  ("launches", ("P6", "P8"), {}),
  ("memory", ("P7",), {}),
  ("llama", ("P10",), {}),
  ("pod_memory", ("M1", "M1-xla"), {}),
  ("pod_flops", ("M2",), {}),
]
LATEST = os.path.join(ROOT, "benchmarks", "latest.json")
README = os.path.join(ROOT, "README.md")
PERFORMANCE_DOC = os.path.join(ROOT, "docs", "performance.md")
# Every document that shows the latest run's table.
TABLE_DOCS = (README, PERFORMANCE_DOC)
_BLOCK = re.compile(r"(<!-- bench:start -->\n)(.*?)(<!-- bench:end -->)", re.S)


def readme_block(rows: list[dict]) -> str:
  """What goes between a document's markers: the table and where it was measured."""
  machines = sorted({f"{r['machine']} ({r['date']})" for r in rows})
  where = "".join(f"\n- {m}" for m in machines)
  return common.markdown(rows) + f"\nMeasured on:{where}\n"


def figure_order(row: dict) -> tuple[bool, str, int, str]:
  """Sorts rows by series (P before the others), then number, so P10 follows P8, not P1.

  Example:
    >>> ids = ["M1-xla", "P10", "M1", "P2"]
    >>> sorted(ids, key=lambda i: figure_order({"id": i}))
    ['P2', 'P10', 'M1', 'M1-xla']
  """
  found = re.fullmatch(r"([A-Z]+)(\d+)(.*)", row["id"])
  if found is None:
    raise ValueError(f"figure id {row['id']!r} is not a letter series and a number, e.g. P10")
  series, number, suffix = found.groups()
  return series != "P", series, int(number), suffix


def update_readme(rows: list[dict], readme: str = README) -> None:
  r"""Replace the table between `readme`'s `bench:start`/`bench:end` markers with `rows`'.

  Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "doc.md")
    >>> _ = open(path, "w").write("intro\n<!-- bench:start -->\nold\n<!-- bench:end -->\nend\n")
    >>> update_readme([], path)
    >>> open(path).read() == f"intro\n<!-- bench:start -->\n{readme_block([])}<!-- bench:end -->\nend\n"
    True
  """
  with open(readme) as f:
    text = f.read()
  if not _BLOCK.search(text):
    raise ValueError(f"{readme} has no <!-- bench:start --> ... <!-- bench:end --> block")
  text = _BLOCK.sub(lambda m: m.group(1) + readme_block(rows) + m.group(3), text)
  with open(readme, "w") as f:
    f.write(text)


def update_docs(rows: list[dict], paths: tuple[str, ...] = TABLE_DOCS) -> None:
  """Write the latest run's table into every document that shows it (the README, docs/performance.md)."""
  for path in paths:
    update_readme(rows, path)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="comma-separated figure ids, e.g. P4,P5")
  parser.add_argument("--out", default=os.path.join(ROOT, "workdir", "bench"))
  parser.add_argument("--update-readme", action="store_true")
  args = parser.parse_args()
  # Ids as registered, whatever their case on the command line (p4, M1-xla).
  registered = {f.upper(): f for _, ids, _ in BENCHMARKS for f in ids}
  asked = {f.strip().upper() for f in args.only.split(",") if f.strip()}
  unknown = asked - set(registered)
  wanted = {registered[f] for f in asked - unknown}
  if unknown:
    raise SystemExit(f"--only={args.only!r}: unknown figures {sorted(unknown)}")
  os.makedirs(args.out, exist_ok=True)
  rows: list[dict] = []
  for module, ids, env in BENCHMARKS:
    if wanted and not wanted & set(ids):
      continue
    path = os.path.join(args.out, f"{module}-{'-'.join(ids)}.json")
    print(f"benchmarks.{module} ({', '.join(ids)}) ...", flush=True)
    start = time.perf_counter()
    subprocess.run(
      [sys.executable, "-m", f"benchmarks.{module}", f"--json={path}"],
      cwd=ROOT,
      env=allocator.with_tcmalloc({**os.environ, **env}),
      check=True,
      stdout=subprocess.DEVNULL,
    )
    print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    with open(path) as f:
      rows += [r for r in json.load(f) if r["id"] in ids and (not wanted or r["id"] in wanted)]
  rows.sort(key=figure_order)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(rows, f, indent=1)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(readme_block(rows))
  print(readme_block(rows), end="")
  if args.update_readme:
    if wanted:  # replace those figures in the latest run, keep the others
      with open(LATEST) as f:
        rows = sorted([r for r in json.load(f) if r["id"] not in wanted] + rows, key=figure_order)
    with open(LATEST, "w") as f:
      json.dump(rows, f, indent=1)
      f.write("\n")
    update_docs(rows)


if __name__ == "__main__":
  main()
