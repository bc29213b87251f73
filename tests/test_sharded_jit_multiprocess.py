"""sharded_jit across real processes on 127.0.0.1 (gloo), each checking itself."""

import pytest

from tests.multiprocess import assert_ok, run_worker

pytestmark = pytest.mark.multiprocess

SCENARIOS = [
  "round trip rows",
  "2-D split + replicated weight",
  "static + keyword-only",
  "all by keyword",
  "grad through local pieces",
  "grad through a replicated output",
  "grad of a replicated input sums over every process's rows",
  "constraints inside, replicated output whole",
  "global array in, global array out",
  "named specs, global arrays, fast path",
  "numpy into a global-only call is a clear error",
  "replicated-only with local_num_partitions",
  "traced once per signature",
]


@pytest.mark.parametrize("num_processes,devices", [(2, 2), (4, 2)])
def test_every_scenario_on_every_process(num_processes, devices):
  result = run_worker(
    "sharded_jit_worker", "all", num_processes=num_processes, devices_per_process=devices
  )
  assert_ok(result)
  for p in result.processes:
    for scenario in SCENARIOS:
      assert f"PASS {scenario}\n" in p.output, result.report()


@pytest.mark.parametrize(
  "mode,expected",
  [
    ("mismatch-shape", "args[0].local_shape: process 0: [8, 8]; process 1: [6, 8]"),
    ("mismatch-dtype", 'args[0].dtype: process 0: "int32"; process 1: "float32"'),
    (
      "mismatch-divisible",
      "process 1: ValueError: argument args[0]: local shape=(7, 8) "
      "is not divisible by the local parts=(2, 1)",
    ),
  ],
)
def test_disagreement_raises_on_every_process(mode, expected):
  result = run_worker("sharded_jit_worker", mode, num_processes=2, devices_per_process=2)
  assert_ok(result)
  for p in result.processes:
    assert "ERROR AgreementError" in p.output and expected in p.output, result.report()


def test_device_assignment_errors_across_processes():
  result = run_worker("sharded_jit_worker", "device-errors", num_processes=2, devices_per_process=2)
  assert_ok(result)
  for p in result.processes:
    assert "Specify 'local_num_partitions'" in p.output, result.report()
    assert "must use all available devices. Got 3 out of 4" in p.output, result.report()
    assert "local_num_partitions=1 but this process has 2 devices" in p.output
