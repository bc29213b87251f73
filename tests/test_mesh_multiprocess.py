"""Meshes and the data layout on real processes (2 x 2 and 4 x 2 CPU devices)."""

import pytest

from tests.multiprocess import assert_ok, run_worker

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("num_processes,devices", [(2, 2), (4, 2)])
def test_mesh_and_layout_on_every_process(num_processes, devices):
  result = run_worker("mesh_worker", num_processes=num_processes, devices_per_process=devices)
  assert_ok(result)
  for p in result.processes:
    for name in ("ici mesh data x tensor", "dcn over processes", "fsdp x tensor"):
      assert f"PASS {name}\n" in p.output, result.report()
