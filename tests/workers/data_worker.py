"""One process of a multi-process input-pipeline test.

Usage: data_worker.py MODE DATASET DATA_DIR OUT_DIR [options as key=value]
  stream   write each step's global-batch hash and this host's record indices; with
           save_at=N, also the state after its first N steps to OUT_DIR/state.json
           (as save writes it), so one job is both a stream and a saved position
  resume   restore from OUT_DIR/state.json and write the next steps' hashes
  save     run some steps and write the state to OUT_DIR/state.json
  open     just open (for the error cases)
Options: global_batch, steps, save_at, seq_len, mesh, seed, data_dir_p<N>, and packed=<identity>
for a packed_lm dataset (windows with segment ids, its plan's identity), or sources=<spec>
for a mixture of data.sources (DATASET is then ignored; the sources are prepared in
DATA_DIR already, by the test, and each host finds them there as spmd-train's do).
"""

import hashlib
import json
import os
import sys

import numpy as np

import spmd

spmd.initialize()

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from spmd.mesh import create_mesh  # noqa: E402
from trainers.data.read import lm_examples, pipeline  # noqa: E402

mode, dataset, data_dir, out_dir = sys.argv[1:5]
opts = dict(a.split("=", 1) for a in sys.argv[5:])
pid = jax.process_index()
if f"data_dir_p{pid}" in opts:  # this host has its own (maybe broken) copy
  data_dir = opts[f"data_dir_p{pid}"]
global_batch = int(opts.get("global_batch", 16))
steps = int(opts.get("steps", 4))
seq_len = int(opts.get("seq_len", 16))
mesh = create_mesh(opts.get("mesh", "data=-1"))

packing = {}
if opts.get("packed"):  # one packed window a record (trainers/data/prepare/packed.py)
  from trainers.data.prepare import packed

  packing = dict(
    to_batch=packed.packed_batch(seq_len),
    plan_records=packed.packed_plan(seq_len, lambda: opts["packed"]),
  )


def open_mixture():
  """The LM task's mixture of `opts["sources"]`, opened as spmd-train opens it."""
  from tests.configs import train_tiny
  from trainers.data.read import mixture
  from trainers.tasks import make_task

  config = train_tiny.get_config()
  config.data.update(sources=opts["sources"], pack=True, dir=data_dir, validation_percent=0.0)
  config.model.seq_len = seq_len
  task = make_task(config)
  return mixture.open_mixture_batches(
    task.prepare_data(data_dir),
    "train",
    data_dir,
    task.to_example,
    global_batch,
    mesh,
    seed=int(opts.get("seed", 7)),
    features=tuple(task.record_template),
    to_batch=task.to_batch,
    plan_records=task.plan_records,
  )


try:
  if opts.get("sources"):
    batches = open_mixture()
  else:
    batches = pipeline.open_global_batches(
      dataset,
      "train",
      data_dir,
      packed.packed_example(seq_len) if packing else lm_examples.lm_example(seq_len),
      global_batch,
      mesh,
      seed=int(opts.get("seed", 7)),
      **packing,
    )
except ValueError as e:
  print(f"ERROR {type(e).__name__}: {e}", flush=True)
  sys.exit(3)
except OSError as e:
  print(f"ERROR {type(e).__name__}: {e}", flush=True)
  sys.exit(3)


def global_hash(batch):
  digest = hashlib.sha256()
  for key in sorted(batch):
    digest.update(np.asarray(multihost_utils.process_allgather(batch[key], tiled=True)).tobytes())
  return digest.hexdigest()[:16]


def write(name, obj):
  with open(os.path.join(out_dir, name), "w") as f:
    json.dump(obj, f)


if mode == "stream":
  hashes, indices = {}, {}
  it = batches.iterator(0, prefetch=2, num_steps=steps)
  for step, batch in it:
    if pid == 0 and step + 1 == int(opts.get("save_at", 0)):  # save_at steps consumed
      write("state.json", it.state().to_dict())
    hashes[step] = global_hash(batch)
    if opts.get("sources"):  # (source, example of that source) of each of this host's rows
      indices[step] = np.stack(batches.row_sources(step, batches._rows), axis=1).tolist()
    else:
      indices[step] = batches.record_indices(step, batches._rows).tolist()
  if pid == 0:
    write("hashes.json", hashes)
  write(
    f"indices_p{pid}.json",
    {
      "rows": [batches.layout.host().rows.start, batches.layout.host().rows.stop],
      "steps_per_epoch": batches.steps_per_epoch,
      "num_records": batches.num_records,
      "indices": indices,
    },
  )
elif mode == "save":
  it = batches.iterator(0, prefetch=2)
  for _ in range(steps):
    next(it)
  if pid == 0:
    write("state.json", it.state().to_dict())
  it.close()
elif mode == "resume":
  with open(os.path.join(out_dir, "state.json")) as f:
    state = pipeline.PipelineState.from_dict(json.load(f))
  hashes = {}
  for step, batch in batches.iterator(state, prefetch=1, num_steps=steps):
    hashes[step] = global_hash(batch)
  if pid == 0:
    write("resumed.json", hashes)
print("WORKER DONE", flush=True)
