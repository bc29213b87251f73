"""`examples/cnn_classifier`, copied outside the checkout, trained as a user would.

The copy runs with no PYTHONPATH and from its own folder, through the real
launcher and entry point. Its model has BatchNorm statistics (model state
the step updates and checkpoints) and dropout (keys from the seed and the
step), so these runs check what the Task API promises for such a model:
  * the same per-step losses on 1 x 4, 2 x 2 and 4 x 1 (1e-5): against the
    2 x 2 reference, 4 x 1 trains the first half from a fresh start and 1 x 4
    resumes its checkpoint for the second half, from the run's own copy of
    the task;
  * kill -9 of one process mid-run, then the launcher's restart: the final
    parameters and batch statistics are bit-identical to an uninterrupted run;
  * the run keeps its resolved config and a copy of the task's files, and a
    resume can run from that copy alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from tests import injection
from tests.faults import harness
from tests.multiprocess import ROOT
from tests.session_settings import compilation_cache_dir

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 8  # a checkpoint every 2: the kill below lands mid-run with steps to redo and to spare
OVERRIDES = (
  f"--config.train.steps={STEPS}",
  "--config.global_batch=32",
  # Two convolution blocks of the example's three, each with its batch norm, the second with
  # stride 2: every process compiles the step itself, and the blocks are unrolled in it.
  "--config.model.features=(16, 32)",
  "--config.log_every=1",
  "--config.eval_every=0",
  "--config.eval_batches=2",
  "--config.checkpoint.every=2",
  "--config.transfer_guard=disallow",  # no implicit host transfer in the loop
)


# The example's own config plus the test-only fault hooks, for the param hash
# in the summary (tests/injection.py, named by its path: the copy has no
# PYTHONPATH); beside config.py, so the task's relative path and the run's copy
# of its folder are the same.
DEBUG_CONFIG = """
import importlib.util
from pathlib import Path

import ml_collections

_spec = importlib.util.spec_from_file_location("example_config", Path(__file__).with_name("config.py"))
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def get_config():
  config = example.get_config()
  config.hooks = (HOOK_SPEC,)
  config.hook_settings.faults = ml_collections.ConfigDict({"report_param_hash": True})
  return config
""".replace("HOOK_SPEC", repr(injection.HOOK_SPEC))


@pytest.fixture(scope="module")
def example(tmp_path_factory):
  copy = tmp_path_factory.mktemp("elsewhere") / "my_cnn"
  shutil.copytree(
    ROOT / "examples" / "cnn_classifier", copy, ignore=shutil.ignore_patterns("__pycache__")
  )
  (copy / "debug_config.py").write_text(DEBUG_CONFIG)
  return {
    "folder": copy,
    "data": tmp_path_factory.mktemp("cnn_data"),
    "cache": compilation_cache_dir(),
  }


def start(example, workdir: Path, processes: int, devices: int, max_restarts: int = 0, extra=()):
  """`spmd-launch local -- spmd-train --config=<copy>/debug_config.py`, from the copy's folder."""
  train = [
    "trainers.run.train_cli",
    f"--config={example['folder'] / 'debug_config.py'}",
    f"--workdir={workdir}",
    f"--config.data.dir={example['data']}",
    *OVERRIDES,
    *extra,
  ]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the copy needs none
  env["JAX_COMPILATION_CACHE_DIR"] = str(example["cache"])
  return harness.launch(
    train, workdir, processes, devices, max_restarts, 400, env, example["folder"]
  )


def losses(workdir: Path) -> dict[int, float]:
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def reference(example, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("reference") / "run"
  job = start(example, workdir, 2, 2)
  assert job.wait(420) == 0, job.output
  return {"workdir": workdir, "output": job.output, "hash": harness.param_hash(job.output)}


def test_the_copy_trains_on_two_hosts_and_keeps_its_config_and_code(reference):
  out, workdir = reference["output"], reference["workdir"]
  curve = losses(workdir)
  assert sorted(curve) == list(range(1, STEPS + 1)), curve
  assert "images/s" in out and "HFU (compiled matmul FLOPs)" in out, out
  # BatchNorm statistics rule out the per-device gradient path; the log says so.
  assert "flat_grad_reduce is off for this model: the model has non-parameter" in out, out
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["task"].endswith("my_cnn/task.py:make_task"), saved["task"]
  assert {p.name for p in (workdir / "code").iterdir()} >= {"config.py", "task.py", "cnn.py"}
  state = harness.saved_state(workdir, STEPS)
  assert set(state) >= {"params", "model_state", "opt_state"}, sorted(state)
  norms = state["model_state"]["norms"]
  first = norms["0"] if "0" in norms else norms[0]  # orbax may keep list indices as strings
  assert first["mean"].any(), "batch statistics never updated"


def test_same_losses_on_4x1_then_1x4_resumed_from_the_runs_own_copy(example, tmp_path, reference):
  """4 x 1 trains steps 1-4 from a fresh start and saves; 1 x 4 resumes that
  checkpoint to the end from `<workdir>/code/config.py` (the task's copy in the
  run, not the folder it was launched from). Both halves match the 2 x 2
  reference's losses: three host counts, a resume on another host count and a
  resume from the run's own code, in two jobs."""
  workdir = tmp_path / "run"
  half = STEPS // 2
  job = start(example, workdir, 4, 1, extra=(f"--config.train.stop_at_step={half}",))
  assert job.wait(420) == 0, job.output
  first, want = losses(workdir), losses(reference["workdir"])
  assert sorted(first) == list(range(1, half + 1)), first
  alone = dict(example, folder=workdir / "code")
  job = start(alone, workdir, 1, 4)
  assert job.wait(300) == 0, job.output
  assert f"state from checkpoint step {half}" in job.output, job.output
  got = losses(workdir)
  assert sorted(got)[-1] == STEPS, got
  for step in range(1, STEPS + 1):
    host_count = "4 x 1" if step <= half else "1 x 4"
    mine = first[step] if step <= half else got[step]
    assert mine == pytest.approx(want[step], rel=1e-5), (host_count, step, mine, want[step])


def test_kill_9_mid_run_resumes_bit_identical(example, tmp_path, reference):
  workdir = tmp_path / "run"
  job = start(example, workdir, 2, 2, max_restarts=1)
  try:
    # Mid-run, after step 4's checkpoint is committed: saves are asynchronous,
    # so step 5 can be logged while step 4's save is still in flight (the
    # resume would then rightly start from step 2).
    harness.wait_for(
      lambda: (
        harness.last_step(workdir) >= 5 and max(harness.committed_steps(workdir), default=0) >= 4
      ),
      300,
      "step 5, step 4's checkpoint committed",
    )
    running = harness.wait_for(
      lambda: len(found := harness.pids(workdir)) == 2 and found, 60, "both processes"
    )
    os.kill(running[1], signal.SIGKILL)
    code = job.launcher.wait(timeout=400)
  finally:
    job.kill()
  out = job.output
  assert code == 0, out
  assert "failed first: killed by SIGKILL" in out, out
  resumed = harness.resumed_steps(out)
  assert len(resumed) == 1 and resumed[0] >= 4, (resumed, out)
  assert harness.param_hash(out) == reference["hash"], out
