#!/usr/bin/env bash
# The accelerator check in one command, on a machine with one GPU (a few minutes):
#   benchmarks/accelerator_check.sh [--steps=8] [--global_batch=16] [--out=FILE]
# Such a machine may lack this project's data dependencies and have no network:
# wheels in .whl/ (ml_collections, say) are installed into a scratch folder
# first, and nothing else is fetched. PYTHON names the interpreter (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/spmd_check_site .whl/*.whl
  export PYTHONPATH="/tmp/spmd_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
# The step fills most of the device: let JAX's allocator take what it needs.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
exec timeout -k 10 600 "${PYTHON:-python3}" -m benchmarks.accelerator_check "$@"
