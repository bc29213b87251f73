"""Exports a run's checkpoint as safetensors in this process; prints its resident memory before and at the peak.

  python -m tests.workers.export_memory WORKDIR OUT READ_BLOCK_BYTES

The peak is the kernel's high-water mark (VmHWM), reset just before the
measured export (`/proc/self/clear_refs`). A first export, into OUT.warm-up,
comes before: it imports and starts what the export uses (about 200 MiB
here, JAX's and tensorstore's), which stays whatever the model, so that the
measured rise is what the export holds for the model.
"""

from __future__ import annotations

import json
import re
import sys

from trainers.checkpoints import hf_export


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1))


def main() -> None:
  workdir, out, block_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
  hf_export.export(workdir, out + ".warm-up", dtype="float32", read_block_bytes=block_bytes)
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark to the current RSS
  before = _status_kib("VmRSS")
  done = hf_export.export(workdir, out, dtype="float32", read_block_bytes=block_bytes)
  peak = _status_kib("VmHWM")
  print(json.dumps({"before_kib": before, "peak_kib": peak, "parameters": done.parameters}))


if __name__ == "__main__":
  main()
