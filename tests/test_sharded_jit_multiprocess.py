"""sharded_jit across real processes on 127.0.0.1 (gloo), each checking itself."""

import time

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
  "replicated global output, read on every process",
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


def test_device_assignment_errors_across_processes():
  result = run_worker("sharded_jit_worker", "device-errors", num_processes=2, devices_per_process=2)
  assert_ok(result)
  for p in result.processes:
    assert "Specify 'local_num_partitions'" in p.output, result.report()
    assert "must use all available devices. Got 3 out of 4" in p.output, result.report()
    assert "local_num_partitions=1 but this process has 2 devices" in p.output


TRACER_SCENARIOS = [
  "grad of a global array",
  "grad of a global array under jax.jit",
  "vjp of a global array: value",
  "vjp of a global array: global cotangent",
  "vjp of a global array: replicated cotangent",
  "jax.jit of a global array",
  "grad of a global array through local_in_parts",
  "grad of a global array through local_in_parts, jitted",
  "grad of local pieces through local_in_parts",
  "a traced local piece into a global-only call is a clear error",
]


@pytest.fixture(scope="module")
def slow_compile_then_tracers():
  # One job for two claims: the slow compile must be the job's first call.
  return run_worker(
    "sharded_jit_worker", "slow-compile,tracers", num_processes=2, devices_per_process=2
  )


def test_tracers_of_global_arrays_match_one_process_on_the_full_data(slow_compile_then_tracers):
  """jax.grad, jax.vjp and jax.jit of a cross-process call on global arrays."""
  result = slow_compile_then_tracers
  assert_ok(result)
  for p in result.processes:
    for scenario in TRACER_SCENARIOS:
      assert f"PASS {scenario}\n" in p.output, result.report()


def test_no_process_runs_a_new_program_before_every_process_has_compiled_it(
  slow_compile_then_tracers,
):
  """A host that compiles later holds the others back (gloo gives them 30 s at the first run)."""
  result = slow_compile_then_tracers
  assert_ok(result)
  for p in result.processes:
    assert "PASS the first run waits for the slowest compile\n" in p.output, result.report()


def test_a_failure_at_a_new_signature_on_the_fast_path_is_one_round_one_trace():
  """No retry: an AgreementError, or an error from the traced function, raises at once."""
  result = run_worker("sharded_jit_worker", "agree-once", num_processes=2, devices_per_process=2)
  assert_ok(result)
  for p in result.processes:
    assert "static_args: process 0: [10]; process 1: [11]" in p.output, result.report()
    assert "PASS a disagreement on the fast path is one agreement round\n" in p.output, (
      result.report()
    )
    assert "PASS an error while tracing on the fast path traces once\n" in p.output, result.report()


@pytest.mark.parametrize("changing", [1, 0], ids=["another process", "the coordinator"])
def test_a_host_that_changes_its_signature_alone_ends_every_host_with_an_error(changing):
  """The others reuse the cached program: nothing checks them, but nobody hangs.

  The changing host waits in the agreement check and raises, naming what it
  changed; the others, waiting in the program's collective for it, are ended
  by JAX's distributed runtime once it leaves (shutdown barrier, heartbeat).
  """
  agreement_timeout_s = 5
  started = time.monotonic()
  result = run_worker(
    "sharded_jit_worker",
    f"changed-signature={changing}",
    num_processes=2,
    devices_per_process=2,
    timeout_s=120,  # the hard limit, far past the bound checked below
    grace_s=30,
    env={"SPMD_AGREEMENT_TIMEOUT_S": str(agreement_timeout_s)},
  )
  took = time.monotonic() - started
  assert not result.timed_out, result.report()
  for p in result.processes:
    assert p.returncode not in (0, None), result.report()
    assert not p.killed_by_launcher, result.report()  # each ended on its own
    assert "UNEXPECTED" not in p.output, result.report()
  message = result.processes[changing].output
  assert (
    f"sharded_jit(changed_signature.<locals>.<lambda>): processes [{1 - changing}] did not "
    f"reach the agreement check for a new signature within {agreement_timeout_s}s" in message
  ), result.report()
  assert "args[0].local_shape: [8, 8] -> [6, 8]" in message, result.report()
  assert took < 12 * agreement_timeout_s, took  # the same bound as before the 5 s timeout
