"""A plain Python process (one CPU device, no jax.distributed) uses an spmd-export file.

  python tests/workers/exported_model.py EXPORT.npz DATA_DIR EXAMPLES[,EXAMPLES...]

Rebuilds the model from the file alone, runs it over the first EXAMPLES
examples of the eval split in order (0: all of them), read straight from the
prepared records, and prints one JSON line: the loss, its weight, the logits'
shape, and the device count. Several counts (comma-separated) print a line
each, in order, from the one process: a test that needs both a prefix and
the whole split starts one process, not two.
"""

import json
import sys

import jax
import numpy as np

from trainers.checkpoints import export, saved_run
from trainers.data.read import lm_examples
from trainers.data.records.datasets import open_source
from trainers.tasks import lm, make_task
from trainers.tasks.lm_data import CORPUS_RECORD_BYTES


def main(path: str, data_dir: str, examples: int) -> None:
  exported = export.load_export(path)
  config = saved_run.config_from_json(exported.config_json)
  model = export.load_model(path)
  name = make_task(config).prepare_data(data_dir)  # prepared already: returns its name
  records = open_source(name, config.data.eval_split, data_dir, ("tokens",))
  seq_len = config.model.seq_len
  per_record = lm_examples.windows_per_record(CORPUS_RECORD_BYTES, seq_len)
  total = len(records) * per_record
  count = total if examples == 0 else examples
  to_example = lm_examples.lm_example(seq_len)
  loss_sum = weight = 0.0
  shape = None
  for start in range(0, count, 64):
    rows = [
      to_example(records[e // per_record], e % per_record)
      for e in range(start, min(start + 64, count))
    ]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    logits = model(batch["inputs"])
    shape = list(logits.shape) if shape is None else shape
    s, w, _ = lm.next_token_loss(model, batch, None, False)
    loss_sum, weight = loss_sum + float(s), weight + float(w)
  print(
    json.dumps(
      {
        "loss": loss_sum / weight,
        "weight": weight,
        "examples": count,
        "logits_shape": shape,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
      }
    )
  )


if __name__ == "__main__":
  for examples in sys.argv[3].split(","):
    main(sys.argv[1], sys.argv[2], int(examples))
