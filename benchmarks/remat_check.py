"""Does the train step fit only by rematerializing? The TPU compiler's own answer, without a chip.

When a program's temporaries do not fit the chip, XLA:TPU recomputes values
instead of keeping them (its rematerialization pass), and the recomputed
instructions carry a `.remat` suffix in the optimized HLO. Such a step still
fits, so the plan's verdict cannot show it, but it runs slower: a recomputed
matmul costs MFU. This check compiles the real train step for a TPU target
through libtpu (as `spmd-plan` does, on any machine) and counts those names.

  python -m benchmarks.remat_check --rows=7,8          # the check model, v5e-1
  python -m benchmarks.remat_check --rows=8 --tiny      # CPU-sized model
  python -m benchmarks.remat_check --rows=8 --remat_policy=minimal

It prints one line per row count; a count above zero means the step at
that many rows fits only by recomputing.

Example:
  >>> remat_count("%fusion.3 = f32[4]{0} fusion(...)\\n%fusion.3.remat2 = f32[4]{0} fusion(...)")
  1
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ml_collections  # noqa: E402

from benchmarks.tpu_check_config import check_config  # noqa: E402
from trainers.models.llama import REMAT_POLICIES  # noqa: E402
from trainers.planning import plan as plan_lib  # noqa: E402
from trainers.planning.targets import tpu_target  # noqa: E402

# An instruction's name as XLA's rematerialization pass gives it: the
# original name, ".remat" and an optional counter ("%fusion.332.remat3 = ").
_REMAT_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\.remat\d*\s*=", re.MULTILINE)


def remat_count(hlo_text: str) -> int:
  """The instructions of an optimized HLO module that XLA's rematerialization made."""
  return len(_REMAT_NAME.findall(hlo_text))


@dataclasses.dataclass(frozen=True)
class RematReading:
  """What the compiled step says: recomputed instructions, temporaries, whether it compiled."""

  remats: int
  temp_bytes: int | None
  compiled: bool


def step_remats(config: ml_collections.ConfigDict, topology: str = "v5e-1") -> RematReading:
  """Compiles `config`'s train step for `topology` and counts its rematerialized instructions.

  A step the compiler refuses (out of memory) reads as not compiled.
  """
  kept: list = []
  plan_lib.make_plan(
    config, tpu_target(topology), compile_step=True, keep_compiled=kept, verify_suggestions=False
  )
  if not kept:
    return RematReading(remats=0, temp_bytes=None, compiled=False)
  compiled = kept[0]
  return RematReading(
    remats=remat_count(compiled.as_text()),
    temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
    compiled=True,
  )


def _row_counts(text: str) -> list[int]:
  """`--rows`: positive integers, comma-separated."""
  try:
    counts = [int(r) for r in text.split(",")]
  except ValueError:
    counts = []
  if not counts or min(counts) < 1:
    raise argparse.ArgumentTypeError(f"--rows={text!r} must be positive integers, e.g. 7,8")
  return counts


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=_row_counts, default=[8], help="rows a step, or several: 7,8")
  parser.add_argument("--topology", default="v5e-1")
  parser.add_argument("--tiny", action="store_true", help="the CPU-sized check model")
  parser.add_argument(
    "--remat_policy", choices=REMAT_POLICIES, help="model.remat_policy (default: the config's)"
  )
  args = parser.parse_args(argv)
  for rows in args.rows:
    config = check_config(rows, tiny=args.tiny)
    if args.remat_policy:
      config.model.remat_policy = args.remat_policy
    reading = step_remats(config, args.topology)
    temps = "refused" if reading.temp_bytes is None else f"{reading.temp_bytes / 2**20:.1f} MiB"
    print(
      f"rows={rows} topology={args.topology}: {reading.remats} rematerialized "
      f"instructions, temporaries {temps}",
      flush=True,
    )


if __name__ == "__main__":
  main()
