#!/usr/bin/env bash
# The TPU check in one command on a fresh one-chip TPU machine (about eight minutes):
#   benchmarks/tpu_check.sh [--rows=8,12] [--train_steps=60] [--out=FILE]
# It installs the harness's needs from the machine's own index plus the wheels
# in the git-ignored .whl-tpu/ (filled first, on a machine with PyPI, by
# `benchmarks/tpu_setup.sh --download`), then runs benchmarks/tpu_check.py:
# the plan's peak beside its verdict at every row count from 1 to the first
# refused, PL1, PL2 and the verdict at 8 and 12 rows, P9 and P4 at 8 through
# spmd-train's trainer and P11 against a hand-written step. It prints a table and writes
# JSON ($OUT/tpu_check.json, or --out), which
#   python -m benchmarks.run --from-tpu-check=FILE --update-readme
# merges into benchmarks/latest.json and the README's table.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(benchmarks/tpu_setup.sh)"
export PYTHONUNBUFFERED=1
exec timeout -k 10 570 "${PYTHON:-python3}" -m benchmarks.tpu_check --train_steps=60 "$@"
