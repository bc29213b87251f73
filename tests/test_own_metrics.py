"""A user's regression task, written outside the checkout, whose metrics are its own.

The task (an MLP from 7 features to 3 outputs, a Huber loss, no `mask`, on a
dataset it generates itself) reports `mae` and `within_tenth`, not
`accuracy`. Trained as a user would, through the launcher and the entry
point, from its own folder with no PYTHONPATH:
  * 2 x 2 runs to the end, exit 0, and its metrics are in the summary
    (`summary.json` and the printed table), `metrics.jsonl`, TensorBoard and
    the progress bar by their names, with no `eval_accuracy` anywhere;
  * a loss that returns no metrics at all runs to the end as well;
  * the same per-step losses on 1 x 4 as on 2 x 2 (1e-5);
  * a copy of the 2 x 2 run as it stood at step 4, resumed on 4 x 1, ends
    bit-identical to it, step by step: a resume and a third host count in one job;
  * `spmd-train --mode=eval` writes and prints its metrics by name;
  * a metric named `perplexity` (a name the trainer writes) stops the run at
    startup, naming it, before the data is prepared.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from spmd.mesh import create_mesh
from tests import injection
from tests.faults import harness
from tests.session_settings import compilation_cache_dir
from tests.shared_runs import copy_of
from trainers.step import task_metrics
from trainers.step.state import make_state
from trainers.tasks import Task

STEPS = 8
OVERRIDES = (
  f"--config.train.steps={STEPS}",
  "--config.log_every=1",
  "--config.eval_every=4",
  "--config.checkpoint.every=2",
)

DATASET = '''
"""`regression`: 7 features -> 3 targets, a noisy linear map, generated from a seed."""

import os

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

SIZES = {"train": 256, "test": 64}


class Regression(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Generated."}
  code_path = epath.Path(__file__)

  def __init__(self, **kwargs):
    kwargs.setdefault("file_format", tfds.core.FileFormat.ARRAY_RECORD)
    super().__init__(**kwargs)

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      description="regression",
      features=tfds.features.FeaturesDict({
        "x": tfds.features.Tensor(shape=(7,), dtype=np.float32),
        "y": tfds.features.Tensor(shape=(3,), dtype=np.float32),
      }),
    )

  def _split_generators(self, dl_manager):
    return {split: self._generate_examples(split) for split in SIZES}

  def _generate_examples(self, split):
    weights = np.random.default_rng(7).normal(size=(7, 3))
    rng = np.random.default_rng(list(SIZES).index(split))
    x = rng.normal(size=(SIZES[split], 7)).astype(np.float32)
    y = (x @ weights + rng.normal(0.0, 0.1, (SIZES[split], 3))).astype(np.float32)
    for i in range(SIZES[split]):
      yield i, {"x": x[i], "y": y[i]}


def prepare(data_dir):
  builder = Regression(data_dir=os.fspath(data_dir))
  builder.download_and_prepare(
    download_config=tfds.download.DownloadConfig(
      try_download_gcs=False, download_mode=tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS
    )
  )
  return f"{builder.name}:{builder.version}"
'''

TASK = '''
"""An MLP regression with a Huber loss; its metrics are `config.model.metrics`'s choice."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from trainers.tasks import Task, config_section

import regression_data


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  hidden: int = 16
  metrics: str = "own"  # "own": mae and within_tenth; "none": {}; "perplexity": a reserved name


class MLP(nnx.Module):
  def __init__(self, hidden, rngs):
    self.hidden = nnx.Linear(7, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def make_task(config):
  sizes = config_section(ModelConfig, config.model)

  def loss(model, batch, rngs, train):
    error = model(batch["x"]) - batch["y"]
    loss_sum = jnp.sum(optax.huber_loss(error, delta=1.0))
    weight = jnp.asarray(error.shape[0], jnp.float32)  # no mask: every row counts
    row_error = jnp.mean(jnp.abs(error), axis=-1)
    metrics = {
      "own": {"mae": jnp.sum(row_error), "within_tenth": jnp.sum(row_error < 0.1)},
      "none": {},
      "perplexity": {"perplexity": jnp.sum(row_error)},
    }[sizes.metrics]
    return loss_sum, weight, metrics

  return Task(
    model=lambda rngs: MLP(sizes.hidden, rngs),
    loss=loss,
    prepare_data=regression_data.prepare,
    record_template={"x": np.zeros(7, np.float32), "y": np.zeros(3, np.float32)},
    to_example=lambda r: {"x": np.asarray(r["x"], np.float32), "y": np.asarray(r["y"], np.float32)},
  )
'''

CONFIG = """
import ml_collections

from configs import default


def get_config():
  config = default.get_config()
  config.task = "task.py:make_task"
  config.model = ml_collections.ConfigDict({"hidden": 16, "metrics": "own"})
  config.data.name = "regression"
  config.data.eval_split = "test"
  config.global_batch = 16
  config.train.learning_rate = 1e-2
  config.train.warmup_steps = 1
  config.train.weight_decay = 0.0
  config.eval_batches = 0  # the whole test split: 4 batches
  config.sample_tokens = 0
  config.transfer_guard = "disallow"
  config.hooks = (HOOK_SPEC,)  # the param hash (tests/injection.py)
  config.hook_settings.faults = ml_collections.ConfigDict({"report_param_hash": True})
  return config
""".replace("HOOK_SPEC", repr(injection.HOOK_SPEC))


def real_runs(test):
  """The marks of a test that trains with real processes (the reference run included)."""
  for mark in (pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)):
    test = mark(test)
  return test


@pytest.fixture(scope="module")
def project(tmp_path_factory):
  """The user's folder, outside the checkout, and a data dir and compilation cache for its runs."""
  folder = tmp_path_factory.mktemp("elsewhere") / "my_regression"
  folder.mkdir()
  (folder / "regression_data.py").write_text(DATASET)
  (folder / "task.py").write_text(TASK)
  (folder / "config.py").write_text(CONFIG)
  return {
    "folder": folder,
    "data": tmp_path_factory.mktemp("regression_data"),
    "cache": compilation_cache_dir(),
  }


def _env(project) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the folder needs none
  env["JAX_COMPILATION_CACHE_DIR"] = str(project["cache"])
  return env


def train(project, workdir: Path, processes: int, devices: int, *extra: str, data=None):
  """`spmd-launch local -- spmd-train --config=<folder>/config.py`, from the folder; its Job."""
  command = [
    "trainers.run.train_cli",
    f"--config={project['folder'] / 'config.py'}",
    f"--workdir={workdir}",
    f"--config.data.dir={data or project['data']}",
    *OVERRIDES,
    *extra,
  ]
  return harness.launch(
    command, workdir, processes, devices, 0, 300, _env(project), project["folder"]
  )


def records(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def losses(workdir: Path) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in records(workdir) if "loss" in r}


@pytest.fixture(scope="module")
def reference(project, tmp_path_factory):
  """The straight 2 x 2 run of the own-metrics task, shared by the tests below."""
  workdir = tmp_path_factory.mktemp("reference") / "run"
  job = train(project, workdir, 2, 2)
  assert job.wait(320) == 0, job.output
  return {"workdir": workdir, "output": job.output, "hash": harness.param_hash(job.output)}


@real_runs
def test_own_metrics_are_reported_by_their_names(reference):
  workdir, out = reference["workdir"], reference["output"]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == STEPS, summary
  assert {"eval_loss", "eval_mae", "eval_within_tenth"} <= set(summary), summary
  assert 0 < summary["eval_mae"] and 0 <= summary["eval_within_tenth"] <= 1, summary
  assert not [k for k in summary if "accuracy" in k], summary
  # The printed table names them; the progress bar shows the train values.
  assert "eval mae" in out and "eval within_tenth" in out and "accuracy" not in out, out
  assert "mae=" in out and "within_tenth=" in out, out
  rows = records(workdir)
  train_rows = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "eval_loss" in r]
  assert all({"mae", "within_tenth"} <= set(r) for r in train_rows), train_rows[:2]
  assert [r["step"] for r in evals] == [4, 8], evals
  assert evals[-1]["eval_mae"] == pytest.approx(summary["eval_mae"], rel=1e-12), evals
  events = b"".join(p.read_bytes() for p in (workdir / "tensorboard").iterdir())
  assert b"eval_within_tenth" in events and b"mae" in events, "TensorBoard lacks the metrics"


@real_runs
def test_a_loss_without_metrics_runs_to_the_end(project, tmp_path):
  workdir = tmp_path / "run"
  job = train(project, workdir, 2, 2, "--config.model.metrics=none")
  assert job.wait(320) == 0, job.output
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == STEPS and summary["eval_loss"] > 0, summary
  assert not [k for k in summary if k.startswith("eval_") and k != "eval_loss"], summary
  assert "eval loss" in job.output, job.output


@real_runs
def test_same_losses_on_one_host(project, tmp_path, reference):
  """1 x 4 from a fresh start; 4 x 1 is the resume's below."""
  job = train(project, tmp_path / "run", 1, 4)
  assert job.wait(320) == 0, job.output
  got, want = losses(tmp_path / "run"), losses(reference["workdir"])
  assert sorted(want) == list(range(1, STEPS + 1)), want
  for step in range(1, STEPS + 1):
    assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got[step], want[step])


@real_runs
def test_stopped_and_resumed_on_4x1_ends_bit_identical(project, tmp_path, reference):
  # The straight 2 x 2 run as it stood at step 4 (its checkpoint there; stopping
  # at a step and saving is checked by tests/test_train.py), resumed to the end
  # on 4 processes x 1 device: this task's step is the same to the last bit on
  # both layouts, so the resume must end on the same parameters and losses.
  workdir = copy_of(reference["workdir"], tmp_path / "run")
  for later in ("6", "8"):
    shutil.rmtree(workdir / "checkpoints" / later)
  second = train(project, workdir, 4, 1)
  assert second.wait(320) == 0, second.output
  assert "state from checkpoint step 4" in second.output, second.output
  assert reference["hash"] and harness.param_hash(second.output) == reference["hash"], second.output
  got, want = losses(workdir), losses(reference["workdir"])
  assert [got[s] for s in range(5, STEPS + 1)] == [want[s] for s in range(5, STEPS + 1)], got


@real_runs
def test_eval_mode_writes_and_prints_the_metrics_by_name(project, reference, tmp_path):
  workdir = copy_of(reference["workdir"], tmp_path / "run")  # eval writes into its workdir
  job = harness.launch(
    ["trainers.run.train_cli", "--mode=eval", f"--workdir={workdir}"],
    workdir,
    1,
    2,
    0,
    300,
    _env(project),
    project["folder"],
  )
  assert job.wait(320) == 0, job.output
  written = json.loads((workdir / "eval" / f"step_{STEPS}.json").read_text())
  summary = json.loads((workdir / "summary.json").read_text())
  for key in ("eval_loss", "eval_mae", "eval_within_tenth"):
    assert written[key] == pytest.approx(summary[key], rel=1e-5), (key, written, summary)
    assert key in job.output, job.output
  assert "eval_accuracy" not in written, written


@real_runs
def test_a_metric_named_as_the_trainers_own_stops_the_run_before_data(project, tmp_path):
  data = tmp_path / "data"
  job = train(project, tmp_path / "run", 2, 1, "--config.model.metrics=perplexity", data=data)
  assert job.wait(320) == 2, job.output  # a user error: one line, exit 2, never restarted
  assert "returns the metric 'perplexity'" in job.output, job.output
  assert "Traceback" not in job.output, job.output
  assert "Reserved: loss, grad_norm, learning_rate" in job.output, job.output
  assert not data.exists() or not any(data.iterdir()), sorted(data.rglob("*"))
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _stock_task(metrics) -> Task:
  def loss(model, batch, rngs, train):
    out = model(batch["x"])
    return out.sum(), out.shape[0] * 1.0, metrics(out)

  return Task(
    model=lambda rngs: nnx.Linear(7, 3, rngs=rngs),
    loss=loss,
    prepare_data=lambda data_dir: "unused",
    record_template={"x": np.zeros(7, np.float32)},
    to_example=lambda r: {"x": np.asarray(r["x"], np.float32)},
  )


def _names(metrics):
  from configs import default

  config = default.get_config()
  config.global_batch = 4
  task = _stock_task(metrics)
  setup = make_state(task.model, config, create_mesh("data=-1"), ())
  return task_metrics.loss_metric_names(setup, task, config.global_batch)


def test_metric_names_come_from_the_loss_before_any_data():
  names = _names(lambda out: {"mae": out.sum(), "within_tenth": out.max()})
  assert set(names.train) == set(names.eval) == {"mae", "within_tenth"}
  assert _names(lambda out: {}).train == ()


@pytest.mark.parametrize(
  "name", ["loss", "perplexity", "learning_rate", "step", "weight", "examples_per_s", "eval_x"]
)
def test_a_reserved_metric_name_is_refused_naming_it(name):
  with pytest.raises(ValueError, match=f"returns the metric '{name}'.*Reserved: loss, "):
    _names(lambda out: {name: out.sum()})


def test_metrics_must_be_a_dict_of_numbers():
  with pytest.raises(ValueError, match=r"not one number each: \{'rows': \(4, 3\)\}"):
    _names(lambda out: {"rows": out})
  with pytest.raises(TypeError, match="metric_sums a dict"):
    _names(lambda out: [out.sum()])
