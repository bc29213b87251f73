#!/usr/bin/env bash
# P9 at more Llama shapes (two dense, one mixture of experts), through spmd-train, on a fresh one-chip TPU machine:
#   benchmarks/tpu_shapes.sh [--shapes=mha,long,moe] [--steps=24] [--out=FILE]
# It installs the harness's needs as benchmarks/tpu_check.sh does
# (benchmarks/tpu_setup.sh), then runs benchmarks/tpu_shapes.py, which writes
# JSON ($OUT/tpu_shapes.json, or --out) that
#   python -m benchmarks.run --from-tpu-check=FILE --only=P9-mha,P9-long,E-P9 --update-readme
# merges into benchmarks/latest.json and the README's table.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(benchmarks/tpu_setup.sh)"
export PYTHONUNBUFFERED=1
exec timeout -k 10 540 "${PYTHON:-python3}" -m benchmarks.tpu_shapes "$@"
