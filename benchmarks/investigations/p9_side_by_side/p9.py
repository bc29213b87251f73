"""One P9 measurement of the tree it runs in (cwd): the check Llama's step, `p9.py ROWS STEPS NAME`, a JSON line on stdout."""

import json
import sys

sys.path.insert(0, ".")

from benchmarks import tpu_check
from benchmarks.tpu_check_config import check_config

rows, steps = int(sys.argv[1]), int(sys.argv[2])
out = tpu_check.on_device(check_config(rows), steps=steps, warmup=3)
print(
  "P9JSON "
  + json.dumps(
    {
      "tree": sys.argv[3],
      "rows": rows,
      "step_s": out.get("step_s"),
      "mfu": out.get("mfu"),
      "tokens_per_s": out.get("tokens_per_s"),
      "peak": out.get("peak_bytes"),
    }
  ),
  flush=True,
)
