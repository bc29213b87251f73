#!/usr/bin/env bash
# Installs what spmd-harness needs on a TPU machine with no network, into a
# scratch folder ($SPMD_TPU_SITE, default /tmp/site, and /tmp/site-carried), and prints the PYTHONPATH
# to use; the machine's own JAX and libtpu stay first on it.
#
#   eval "$(benchmarks/tpu_setup.sh)"      # then: make test-tpu, python -m benchmarks.tpu_check
#
# From the machine's package index ($SPMD_TPU_INDEX, default file:///opt/pypi/simple)
# with their needs; what that index lacks travels as wheels in the git-ignored
# folder $SPMD_TPU_WHEELS (default .whl-tpu), filled on a machine with PyPI by
#   benchmarks/tpu_setup.sh --download
# A second run on the same machine finds the folder done and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE="${SPMD_TPU_SITE:-/tmp/site}"
INDEX="${SPMD_TPU_INDEX:-file:///opt/pypi/simple}"
WHEELS="${SPMD_TPU_WHEELS:-.whl-tpu}"
PY="${PYTHON:-python3}"
# What the index of a TPU machine lacks (tensorflow-datasets, grain, array-record,
# gcsfs, safetensors and some of their needs), pinned to what the test suite ran with.
CARRIED=(tensorflow-datasets==4.9.10 grain==0.2.18 array-record==0.8.6 gcsfs==2026.10.1
  dm-tree==0.1.10 simple-parsing==0.1.9 tensorflow-metadata==1.21.0 portpicker==1.6.0
  immutabledict==4.3.1 termcolor==3.3.0 toml==0.10.2 docstring-parser==0.18.0
  googleapis-common-protos==1.76.0 six==1.17.0 attrs==26.1.0 cloudpickle==3.1.3 wrapt==2.5.2
  psutil==7.2.2 zipp==4.1.2 fsspec==2026.9.0 safetensors==0.8.0)
# From the index, with what they need (setup.py's install_requires but the carried).
FROM_INDEX=(flax optax orbax-checkpoint ml-collections absl-py etils tokenizers sentencepiece
  pyarrow zstandard tensorboardX matplotlib tqdm pyyaml importlib_resources pytest-timeout)

pip() { PIP_CONFIG_FILE=/dev/null "$PY" -m pip --disable-pip-version-check "$@"; }

if [[ "${1:-}" == "--download" ]]; then
  mkdir -p "$WHEELS"
  platforms=()
  for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${n}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d "$WHEELS" "${CARRIED[@]}"
  # promise is published as an sdist only: build its (pure Python) wheel here.
  python3 -m pip wheel -q --no-deps -w "$WHEELS" promise==2.3
  du -sh "$WHEELS" >&2
  exit 0
fi

if [[ ! -e "$SITE/.spmd-installed" ]]; then
  started=$SECONDS
  from_index() {
    pip install --isolated -q --only-binary=:all: --no-compile --upgrade --index-url "$INDEX" \
      --target "$SITE" "$@" >&2
  }
  # All at once; where the index cannot satisfy that, each that it can.
  if ! from_index "${FROM_INDEX[@]}"; then
    for name in "${FROM_INDEX[@]}"; do from_index "$name" || echo "tpu_setup: not installed: $name" >&2; done
  fi
  # A folder of their own, after the index's on the path: a package both
  # hold is the index's, and pip's --target never replaces one folder's
  # namespace package (google/) with another's.
  pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE-carried" "$WHEELS"/*.whl >&2
  touch "$SITE/.spmd-installed"
  echo "tpu_setup: installed into $SITE in $((SECONDS - started)) s" >&2
fi
echo "export PYTHONPATH=\"${PYTHONPATH:+$PYTHONPATH:}$SITE:$SITE-carried:$PWD\""
