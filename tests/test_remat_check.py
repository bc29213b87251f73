"""The rematerialization check (`benchmarks.remat_check`) tells a step that fits only by recomputing."""

import os
import subprocess
import sys

import pytest

from benchmarks import remat_check
from benchmarks.remat_check import remat_count
from spmd.topology import libtpu_available
from tests.multiprocess import ROOT

needs_libtpu = pytest.mark.skipif(
  not libtpu_available(), reason="needs libtpu: pip install -e '.[tpu]' (CI installs it)"
)


def test_only_the_names_the_rematerialization_pass_gives_are_counted():
  text = "\n".join(
    [
      "%fusion.332 = bf16[8,4]{1,0} fusion(%p0), kind=kOutput, calls=%fused_computation.1",
      "%fusion.332.remat3 = bf16[8,4]{1,0} fusion(%p0), kind=kOutput, calls=%fused.2",
      "  ROOT %copy.remat = bf16[8,4]{1,0} copy(%fusion.332.remat3)",
      "%add = bf16[8,4]{1,0} add(%fusion.332.remat3, %copy.remat)",
    ]
  )
  assert remat_count(text) == 2


# The CPU-sized model at two row counts 4x apart, around the line.
ROWS = ("--tiny", "--remat_policy=minimal", "--rows=6,24")


@pytest.mark.multiprocess
@needs_libtpu
def test_the_check_finds_recomputation_past_the_chips_memory_and_none_before():
  """The CPU-sized check model for a v5e chip that libtpu is told has 48 MiB of HBM.

  Its own process: libtpu reads LIBTPU_INIT_ARGS once, when it starts. At 24
  rows the step's temporaries exceed what that chip leaves and XLA
  recomputes; at 6 rows (4x fewer) it keeps everything.
  """
  env = {k: v for k, v in os.environ.items() if k not in ("TPU_LOG_DIR", "LIBTPU_INIT_ARGS")}
  done = subprocess.run(
    ["timeout", "-k", "5", "300", sys.executable, "-m", "benchmarks.remat_check", *ROWS],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(env, PYTHONPATH=str(ROOT), LIBTPU_INIT_ARGS="--xla_tpu_max_hbm_size_mib=48"),
  )
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  counts = {
    line.split()[0]: int(line.split(": ")[1].split()[0])
    for line in done.stdout.splitlines()
    if line.startswith("rows=")
  }
  assert counts["rows=6"] == 0, done.stdout
  assert counts["rows=24"] > 0, done.stdout


def test_a_bad_row_count_is_one_line_and_exit_2(capsys):
  with pytest.raises(SystemExit) as exited:
    remat_check.main(["--rows=8,x"])
  assert exited.value.code == 2
  assert "--rows='8,x' must be positive integers" in capsys.readouterr().err.splitlines()[-1]


# The check model's layers at a depth and width where what they keep is most
# of the step's memory (as in the 501M model, whose own compile takes minutes).
_DEEP_SMALL_LLAMA = """
from benchmarks.remat_check import step_remats
from benchmarks.tpu_check_config import check_config
config = check_config(11, tiny=True)
config.model.update(num_layers=16, d_model=256, d_ff=512)
reading = step_remats(config)
print("compiled", reading.compiled, "remats", reading.remats)
"""


@pytest.mark.multiprocess
@needs_libtpu
def test_the_check_models_policy_fits_a_batch_that_keeping_every_product_does_not():
  """The check model's `remat_policy` at 11 rows on a v5e told it has 280 MiB: no recomputing.

  Keeping every weight matmul's output ("minimal"), the compiler refuses
  this step; the check model's policy keeps the query, key and value
  projections' outputs out of the stacks and keeps splash's output and
  log-sum-exp (177 against 187 MiB of temporaries at this size: "minimal"
  first compiles at 286 MiB, this policy at 278, and both are refused at
  274), and the step compiles as written.
  Its own process for LIBTPU_INIT_ARGS, as above.
  """
  env = {k: v for k, v in os.environ.items() if k not in ("TPU_LOG_DIR", "LIBTPU_INIT_ARGS")}
  done = subprocess.run(
    ["timeout", "-k", "5", "300", sys.executable, "-c", _DEEP_SMALL_LLAMA],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(env, PYTHONPATH=str(ROOT), LIBTPU_INIT_ARGS="--xla_tpu_max_hbm_size_mib=280"),
  )
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  assert "compiled True remats 0" in done.stdout, done.stdout
