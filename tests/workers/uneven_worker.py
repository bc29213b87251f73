"""One process of the uneven-data fault test: data that does not divide, eval rows on few hosts.

Usage: uneven_worker.py TRAIN_RECORDS EVAL_RECORDS GLOBAL_BATCH
Prints one `RESULT {json}` line: this host's step counts, the train records
it fed over one epoch, and the eval totals it saw through a collective.
"""

import json
import sys

import numpy as np

import spmd

spmd.initialize()

import jax  # noqa: E402

from spmd.mesh import create_mesh  # noqa: E402
from trainers.data.read import lm_examples, pipeline  # noqa: E402

SEQ_LEN = 16
n_train, n_eval, global_batch = (int(a) for a in sys.argv[1:4])
mesh = create_mesh("data=-1")


def records(n):
  return [{"tokens": (np.arange(SEQ_LEN + 1) + i).astype(np.uint8)} for i in range(n)]


example = lm_examples.lm_example(SEQ_LEN)
train = pipeline.GlobalBatches(records(n_train), example, global_batch, mesh, seed=3, train=True)
evaluation = pipeline.GlobalBatches(records(n_eval), example, global_batch, mesh, train=False)
total = jax.jit(lambda x: x.sum())  # over the global array: every host takes part

fed, train_steps = [], 0
for step, batch in train.iterator(0, prefetch=1, num_steps=train.steps_per_epoch):
  fed += train.record_indices(step, train._rows).tolist()
  total(batch["inputs"]).block_until_ready()
  train_steps += 1
mask_total, real_rows, eval_steps = 0.0, 0, 0
for step, batch in evaluation.iterator(0, prefetch=1, num_steps=evaluation.steps_per_epoch):
  mask_total += float(total(batch["mask"]))
  real_rows += int(evaluation.host_batch(step)["mask"].any(axis=-1).sum())
  eval_steps += 1
print(
  "RESULT "
  + json.dumps(
    {
      "process": jax.process_index(),
      "train_steps": train_steps,
      "fed": fed,
      "eval_steps": eval_steps,
      "eval_mask_total": mask_total,
      "eval_rows_here": real_rows,
    }
  ),
  flush=True,
)
