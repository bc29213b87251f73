"""Plans for one-host TPU slices, and a verdict that is the TPU compiler's.

Users start on one host: v5e-1, -4, -8, v6e-1 to -8, v4-8, v5p-8. libtpu's
default host (2x2 chips), or a `TPU_CHIPS_PER_HOST_BOUNDS` that a TPU VM sets
for its own host, cannot describe them (`v5e:1x1 is not divisible by
chips_per_host_bounds 2x2x1`); `spmd.topology.chips_per_host` gives libtpu
each slice's own host. These compile for libtpu's descriptions on this CPU.

The verdict: for a TPU target the step's compiler is the target's own, so a
step it compiles fits and one it refuses does not; the margin is a warning
beside the verdict (the chip ran an 8-row step of the 501M Llama whose
analysed total leaves less than 10 % of HBM free). Compiled for CPU
stand-ins (GPUs), temporaries are estimates and the margin stays the rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spmd.topology import chips_per_host, libtpu_available, topology_devices
from trainers.planning import plan as plan_lib
from trainers.planning import targets
from trainers.planning.figures import Memory
from trainers.planning.report import _bytes, format_plan
from trainers.reporting import chips

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_libtpu = pytest.mark.skipif(
  not libtpu_available(), reason="needs libtpu: pip install -e '.[tpu]' (CI installs it)"
)
# (slice, chips): every one a single host.
ONE_HOST_SLICES = [
  ("v5e-1", 1),
  ("v5e-4", 4),
  ("v5e-8", 8),
  ("v6e-1", 1),
  ("v6e-4", 4),
  ("v6e-8", 8),
  ("v4-8", 4),
  ("v5p-8", 4),
]
# A one-chip v5e machine's own variables (it sits in a 2x2 host).
CHIP_ENV = {
  "TPU_ACCELERATOR_TYPE": "v5litepod-4",
  "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
  "TPU_HOST_BOUNDS": "1,1,1",
  "TPU_WORKER_HOSTNAMES": "localhost",
}
GiB = 2**30


def test_each_slice_gets_its_own_host_shape():
  assert [chips_per_host(name) for name, _ in ONE_HOST_SLICES] == [
    (1, 1, 1),
    (2, 2, 1),
    (2, 4, 1),
    (1, 1, 1),
    (2, 2, 1),
    (2, 4, 1),
    (2, 2, 1),
    (2, 2, 1),
  ]
  # Pods keep hosts of 2x2 chips.
  assert {chips_per_host(n) for n in ("v5e-16", "v6e-256", "v4-32", "v5p-64")} == {(2, 2, 1)}


@needs_libtpu
@pytest.mark.parametrize("name,chips", ONE_HOST_SLICES)
def test_one_host_slices_are_described_as_one_host(name, chips):
  devices = topology_devices(name)
  assert len(devices) == chips and {d.process_index for d in devices} == {0}
  target = targets.tpu_target(name)
  assert (target.hosts, target.devices_per_host, target.estimated) == (1, chips, False)


@needs_libtpu
def test_pods_keep_their_hosts():
  assert len({d.process_index for d in topology_devices("v5e-16")}) == 4
  assert len({d.process_index for d in topology_devices("v5p-64")}) == 8


@needs_libtpu
@pytest.mark.slow
# v5e-1's plan of the same config is test_spmd_plan_for_v5e_1_on_a_tpu_vm_...'s,
# which checks the same figures through spmd-plan.
@pytest.mark.parametrize("name", ["v6e-8", "v5p-8"])
def test_a_one_host_slice_plans_and_its_compiler_gives_the_verdict(name):
  from configs import llama_tiny

  config = llama_tiny.get_config()
  # 8 rows, not llama_tiny's 32 (libtpu's compile time grows with the rows): one
  # or more a device on both slices, and the claim is the host count and who judges.
  config.global_batch = 8
  plan = plan_lib.make_plan(config, targets.tpu_target(name), verify_suggestions=False)
  assert plan.compiled and plan.hosts == 1 and plan.num_devices == len(topology_devices(name))
  assert (plan.fits, plan.verdict_by) == (True, "compiler")


def _memory(total_gib: float | None, device_gib: float = 15.75) -> Memory:
  return Memory(
    params_bytes=2 * GiB,
    optimizer_bytes=4 * GiB,
    batch_bytes=0,
    temp_bytes=None if total_gib is None else int((total_gib - 6) * GiB),
    code_bytes=0,
    total_bytes=None if total_gib is None else int(total_gib * GiB),
    device_bytes=int(device_gib * GiB),
    margin=0.1,
  )


def test_the_tpu_compiler_gives_the_verdict_and_the_margin_only_warns():
  # The 8-row 501M step: 16.42 GiB analysed, compiled by libtpu, ran on the chip.
  near = _memory(16.42)
  assert plan_lib._fits(near, None, compiled=True, estimated=False) == (True, "compiler")
  assert near.short_of_margin
  # The compiler's refusal is the verdict, whatever the figures say.
  refused = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm"
  assert plan_lib._fits(_memory(10.0), refused, compiled=False, estimated=False) == (
    False,
    "compiler",
  )
  # CPU stand-ins (GPUs): estimated temporaries, so the margin is the rule.
  assert plan_lib._fits(_memory(15.0), None, compiled=True, estimated=True) == (False, "estimate")
  assert plan_lib._fits(_memory(12.0), None, compiled=True, estimated=True) == (True, "estimate")
  # Not compiled: only a state larger than the device is a verdict.
  assert plan_lib._fits(_memory(None, device_gib=5.0), None, False, False) == (False, "state")
  assert plan_lib._fits(_memory(None), None, False, False) == (None, "")


def test_a_v5e_program_may_use_what_the_chip_reports():
  # memory_stats()["bytes_limit"] on the chip, and the "available HBM" its compiler names.
  assert chips.device_memory_bytes("TPU v5 lite") == 16_909_336_064


def _spmd_plan(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
  return subprocess.run(
    ["timeout", "-k", "5", "300", sys.executable, "-m", "trainers.planning.plan_cli", *args],
    env={**os.environ, **env, "PYTHONPATH": ROOT},
    cwd=ROOT,
    capture_output=True,
    text=True,
  )


@needs_libtpu
@pytest.mark.multiprocess
def test_spmd_plan_for_v5e_1_on_a_tpu_vm_plans_and_a_bad_slice_is_one_line():
  """Run where the chip's own variables are set, as on the one-chip machine.

  Also v5e-1's case of the one-host slices above: compiled, one host, and the
  compiler's verdict.
  """
  # 4 rows, not llama_tiny's 32: libtpu's code, and its compile time, grow with the rows.
  config = ("--config=configs/llama_tiny.py", "--config.global_batch=4")
  done = _spmd_plan(*config, "--topology=v5e-1", "--json", env=CHIP_ENV)
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  plan = json.loads(done.stdout)
  assert (
    plan["compiled"],
    plan["num_devices"],
    plan["hosts"],
    plan["fits"],
    plan["verdict_by"],
  ) == (True, 1, 1, True, "compiler")
  bad = _spmd_plan(*config, "--topology=v5e:3x3", env=CHIP_ENV)
  assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
  lines = [line for line in bad.stderr.splitlines() if line.startswith("spmd-plan: ")]
  assert len(lines) == 1 and "libtpu cannot describe TPU slice 'v5e:3x3'" in lines[0], bad.stderr


# What libtpu prints when it loads on a machine that is no TPU VM and is told
# nothing about a slice.
LIBTPU_ALARMS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "InitGoogle", "INVALID_ARGUMENT")


@needs_libtpu
@pytest.mark.multiprocess
def test_spmd_plan_on_a_machine_without_tpus_prints_its_report_and_no_libtpu_alarm():
  """A laptop or CI runner: no TPU variables, libtpu loaded only to describe the slice."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "MEGASCALE_"))}
  command = [sys.executable, "-m", "trainers.planning.plan_cli", "--config=configs/llama_tiny.py"]
  done = subprocess.run(
    [*command, "--topology=v5p-64", "--compile=never"],
    env={**env, "PYTHONPATH": ROOT},
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stdout + done.stderr[-3000:]
  assert done.stdout.startswith("spmd-plan: llama_tiny.py on v5p-64: 32 x TPU v5"), done.stdout
  alarms = [line for line in done.stderr.splitlines() if any(a in line for a in LIBTPU_ALARMS)]
  assert alarms == [], done.stderr


def _llama_near_a_v5e_chips_hbm(rows: int):
  """A Llama whose state and activations meet a v5e chip's HBM between 1 and 2 rows.

  Two layers of the check Llama's width doubled (d_model 3072), a 96,400-id
  vocabulary: about 8.9 GiB of float32 parameters and Adam moments per chip;
  XLA's attention at 4096 tokens writes each layer's scores out, about 2.8
  GiB a row. At 1 row the arguments plus the temporaries libtpu reports
  exceed the chip's HBM, though its temporaries already hold the state.
  """
  from configs import llama_tpu_check

  config = llama_tpu_check.get_config()
  config.model.update(
    num_layers=2,
    d_model=3072,
    num_heads=24,
    num_kv_heads=8,
    d_ff=8192,
    seq_len=4096,
    attention="xla",
    vocab_size=96400,
  )
  config.global_batch = rows
  return config


@needs_libtpu
@pytest.mark.slow
def test_the_printed_total_agrees_with_the_verdict_at_every_row_count_to_the_first_refused():
  """At most the chip's HBM where the step fits, above it where the compiler refuses it.

  Compiles its own steps: no shared run holds a plan, and the claim is about
  the row counts on each side of this chip's line.
  """
  target = targets.tpu_target("v5e-1")
  for rows in range(1, 5):
    plan = plan_lib.make_plan(_llama_near_a_v5e_chips_hbm(rows), target, verify_suggestions=False)
    total, hbm = plan.memory.total_bytes, plan.memory.device_bytes
    if not plan.fits:
      break
    assert total <= hbm, f"{rows} rows: FITS, but {total / GiB:.2f} of {hbm / GiB:.2f} GiB"
  assert rows > 1 and not plan.fits, "the line moved: the test no longer has a row on each side"
  # The refused step's figure is the compiler's, so is what it is short by.
  assert total > hbm, f"{rows} rows: refused, but {total / GiB:.2f} of {hbm / GiB:.2f} GiB"
  verdict = format_plan(plan).split("verdict", 1)[1].splitlines()[0]
  assert f"short by {_bytes(total - hbm)} of {_bytes(hbm)}" in verdict, verdict
