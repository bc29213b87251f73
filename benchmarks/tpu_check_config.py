"""The TPU check's Llama: `configs/llama_tpu_check.py` at a row count, or CPU-sized (`--tiny`).

The check (`benchmarks/tpu_check.py`), the hand-written step it is set
against (`benchmarks/tpu_llama.py`) and the knob sweep
(`benchmarks/tpu_tuning_sweep.py`) all build this config; it sits below
them so that none imports another to reach it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from configs import llama_tpu_check  # noqa: E402
from trainers.config import resolve  # noqa: E402

# `--tiny`: the same check at a size a CPU compiles in seconds (its own test).
TINY = {
  "num_layers": 2,
  "d_model": 128,
  "num_heads": 4,
  "num_kv_heads": 2,
  "d_ff": 256,
  "vocab_size": 512,
  "seq_len": 256,
}


def check_config(rows: int, tiny: bool = False):
  """`configs/llama_tpu_check.py` with `rows` rows a step (`--tiny`: CPU-sized)."""
  config = llama_tpu_check.get_config()
  if tiny:
    config.model.update(TINY)
  config.global_batch = rows
  return resolve(config, ROOT / "configs" / "llama_tpu_check.py")
