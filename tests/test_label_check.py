"""A label outside the classes under mask 1 stops a run, named; under mask 0 it is ignored.

A compiled step cannot raise (a host callback would keep it out of JAX's
persistent compilation cache), so each host checks its rows while they are
still numpy, before placing them (`Task.label_classes`). The run here is
the real trainer on the generated `blobs` data (10 classes) with a model of
8 classes: labels 8 and 9 are in the data, as when a dataset and a config
disagree.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from configs import mlp
from tests.session_settings import compilation_cache_dir
from trainers.run.train import train_and_evaluate
from trainers.tasks import check_host_labels, make_task


@pytest.mark.slow
def test_a_run_whose_data_holds_a_label_past_the_classes_stops_naming_it(tmp_path):
  """Its own run: it stops at the first batch, so no shared trained run would do."""
  config = mlp.get_config()
  config.data.dir = str(tmp_path / "data")
  config.compilation_cache_dir = compilation_cache_dir()
  config.model.num_classes = 8  # blobs has 10: labels 8 and 9 are outside
  config.train.steps, config.eval_every, config.checkpoint.every = 2, 0, 0
  with pytest.raises(ValueError) as raised:
    train_and_evaluate(config, str(tmp_path / "run"))
  chain, error = [], raised.value
  while error is not None:  # the loop may wrap the input thread's error
    chain.append(str(error))
    error = error.__cause__ or error.__context__
  found = [m for m in chain if "is outside [0, 8)" in m]
  assert found, chain
  match = re.search(
    r"step 0: targets\[(\d+)\]=(\d+) is outside \[0, 8\) where the mask is 1", found[0]
  )
  assert match and int(match.group(2)) in (8, 9), found[0]
  assert 0 <= int(match.group(1)) < config.global_batch


def test_the_host_check_ignores_masked_labels_and_names_the_global_row():
  rows = {
    "targets": np.array([[1, -100, 5], [2, 3, 300]]),
    "mask": np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]),
  }
  check_host_labels(3, rows, {"targets": 256})  # -100 and 300 are masked
  rows["mask"][1, 2] = 1.0
  with pytest.raises(ValueError, match=r"step 3: targets\[9, 2\]=300 is outside \[0, 256\)"):
    check_host_labels(3, rows, {"targets": 256}, first_row=8)


def test_the_built_in_tasks_name_their_labels():
  from configs import llama_tiny, lm_tiny_bytes

  assert make_task(mlp.get_config()).label_classes == {"targets": 10}
  assert make_task(lm_tiny_bytes.get_config()).label_classes == {"targets": 256}
  assert make_task(llama_tiny.get_config()).label_classes == {"targets": 1024}
