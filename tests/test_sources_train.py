"""`spmd-launch local ... -- spmd-train --config.data.sources=...` on a JSONL and a Parquet
source it has never seen: `configs/llama_tiny.py` trains on their 0.7 / 0.3 mixture and
reports each source's share; and a run stopped on 2 processes resumes on 4 to the same
weights, bit for bit, as the run that never stopped. A preparation step that outlasts
data.prepare_timeout_s stops the run with one line naming the step and the setting.

The resume is checked on the tests' tiny LM (`tests/configs/train_tiny.py`), whose step is
the same to the last bit on 2 x 2 and 4 x 1 devices; llama_tiny's is not (its weights after
a few steps differ in the last bits between those layouts, on any data), so on it only the
data could be compared bit for bit, and tests/test_mixture_multiprocess.py does that.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.data_fixtures import source_texts, write_jsonl, write_parquet
from tests.multiprocess import ROOT
from tests.session_settings import compilation_cache_dir, default_emitters
from tests.shared_runs import copy_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(1200)]

TINY = str(ROOT / "tests" / "configs" / "train_tiny.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("sources_train")
  a = write_jsonl(root / "DIR_A", source_texts(120, seed=1), files=3)
  b = write_parquet(root / "DIR_B", source_texts(80, seed=2), files=2)
  return {"sources": f"{a}@0.7,{b}@0.3", "data": root / "data", "cache": compilation_cache_dir()}


def launch(corpus, workdir, num_processes, devices, config, *overrides):
  """`spmd-launch local --num-processes N --devices-per-process D -- spmd-train ...`."""
  command = [
    *(sys.executable, "-m", "launch.launch_cli", "local"),
    f"--num-processes={num_processes}",
    f"--devices-per-process={devices}",
    "--timeout=540",  # the launcher's own bound, inside the test's
    *("--", sys.executable, "-m", "trainers.run.train_cli"),
    f"--config={config}",
    f"--config.data.sources={corpus['sources']}",
    f"--workdir={workdir}",
    f"--config.data.dir={corpus['data']}",
    "--config.data.validation_percent=10",
    "--config.log_every=1",
    "--config.sample_tokens=0",
    *overrides,
  ]
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=str(corpus["cache"]))
  # Its own process group, so that a hung run is killed whole (a hung test is a failed one).
  launcher = subprocess.Popen(
    command,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    cwd=str(ROOT),
    env=env,
    start_new_session=True,
  )
  try:
    output, _ = launcher.communicate(timeout=600)
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.wait()
  assert launcher.returncode == 0, output[-5000:]
  return output


def losses(workdir):
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def param_hash(output):
  return re.search(r"\[p0\]\s+param hash\s+: (\w+)", output).group(1)


def test_llama_tiny_trains_on_a_mixture_of_jsonl_and_parquet_it_has_never_seen(corpus, tmp_path):
  steps = 4
  out = launch(
    corpus,
    tmp_path / "run",
    2,
    2,
    "configs/llama_tiny.py",
    f"--config.train.steps={steps}",
    "--config.eval_every=0",
    # One layer (llama_tiny unrolls its two): the claim is the data's, and each of the two
    # processes compiles the step itself.
    "--config.model.num_layers=1",
  )
  # Both sources prepared (a BPE from a sample of both), then their mixture, logged.
  # Each prepared by both processes at once, each its share (trainers/data/prepare/source_shards.py).
  assert "preparing '" in out and "DIR_A/*.jsonl' (train split, 3 files) on 2 processes" in out
  assert "DIR_B/*.parquet' (train split, 2 files) on 2 processes" in out
  assert re.search(r"train split: mixture 2 sources: '.*DIR_A/\*.jsonl': .* 70.0% of rows", out)
  assert "30.0% of rows" in out and "each source's share of tokens and its epochs" in out
  curve = losses(tmp_path / "run")
  assert sorted(curve) == list(range(1, steps + 1)) and curve[steps] < curve[1], curve
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  fed = summary["data_sources"]
  assert [f["source"].rsplit("/", 2)[-2] for f in fed] == ["DIR_A", "DIR_B"]
  assert [round(f["weight"], 6) for f in fed] == [0.7, 0.3]
  assert abs(fed[0]["share"] - 0.7) < 0.02 and abs(fed[1]["share"] - 0.3) < 0.02, fed
  assert sum(f["rows"] for f in fed) == steps * 32 and all(f["tokens"] > 0 for f in fed)
  assert "data sources (share, epochs)" in out


# Compared to the last bit across host counts: XLA's default emitters (tests/session_settings.py).
@default_emitters()
def test_a_run_stopped_on_2_processes_resumes_bit_identically_on_4(corpus, tmp_path):
  """Two runs, both needed: the straight one on 2 x 2 and its copy resumed on 4 x 1.

  The packed tiny LM for 12 steps saved every 6 is tests/test_staged_data.py's resume
  too: its 2 x 2 and 4 x 1 steps are the same programs, compiled once for both
  modules (the compilation cache), though their data differ."""
  flags = ("--config.data.pack=True", "--config.train.steps=12", "--config.checkpoint.every=6")
  straight = launch(corpus, tmp_path / "straight", 2, 2, TINY, *flags)
  # The straight run as it stood at step 6 (its checkpoint and mixture position
  # there), resumed on 4 processes; stopping at a step is checked in tests/test_train.py.
  copy_of(tmp_path / "straight", tmp_path / "run")
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "12")
  resumed = launch(corpus, tmp_path / "run", 4, 1, TINY, *flags)
  assert re.search(r"state from\s+: checkpoint step 6\n", resumed), resumed[-3000:]
  assert param_hash(resumed) == param_hash(straight)
  got, expected = losses(tmp_path / "run"), losses(tmp_path / "straight")
  assert [got[s] for s in range(1, 13)] == [expected[s] for s in range(1, 13)]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  reference = json.loads((tmp_path / "straight" / "summary.json").read_text())
  assert summary["data_sources"] == reference["data_sources"]


def test_a_preparation_step_past_its_timeout_is_one_line_naming_the_step_and_the_setting(
  corpus, tmp_path
):
  """Process 0 trains the BPE for longer than data.prepare_timeout_s (the worker pauses it
  there); process 1, waiting for it at the preparation's barrier, stops with one line and
  exit 2 naming what was being prepared and the setting, not the runtime's DEADLINE_EXCEEDED
  traceback. Starts its own processes and trains nothing."""
  timeout_s = 2
  command = [
    *(sys.executable, "-m", "launch.launch_cli", "local"),
    "--num-processes=2",
    "--devices-per-process=1",
    "--timeout=120",
    *("--", sys.executable, "-m", "tests.workers.slow_tokenizer_train"),
    f"--config={TINY}",
    f"--config.data.sources={corpus['sources']}",
    f"--workdir={tmp_path / 'run'}",
    f"--config.data.dir={tmp_path / 'data'}",
    "--config.data.pack=True",
    "--config.data.tokenizer=bpe",
    "--config.model.vocab_size=400",
    f"--config.data.prepare_timeout_s={timeout_s}",
  ]
  env = dict(os.environ, PYTHONPATH=str(ROOT), SPMD_TEST_PAUSE_S=str(20 * timeout_s))
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
  output = done.stdout + done.stderr
  assert done.returncode == 2, output[-5000:]
  assert "Traceback" not in output, output[-5000:]
  (line,) = [x for x in output.splitlines() if x.startswith("[p1] spmd-train: ")]
  assert "tokenizer" in line and f"data.prepare_timeout_s={timeout_s}" in line, line
