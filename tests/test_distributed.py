"""spmd.initialize(): settings from arguments and environment; loopback binding."""

import pytest

import spmd
from spmd import distributed


def test_single_process_is_a_no_op(monkeypatch):
  for name in (
    distributed.ENV_COORDINATOR,
    distributed.ENV_NUM_PROCESSES,
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
  ):
    monkeypatch.delenv(name, raising=False)
  info = spmd.initialize()
  assert (info.process_count, info.process_index, info.local_device_count) == (1, 0, 8)
  assert info.coordinator_address is None
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "1")
  assert spmd.initialize().process_count == 1


def test_incomplete_or_malformed_settings_are_named(monkeypatch):
  monkeypatch.setattr(distributed, "cluster_detected", lambda: False)
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
  monkeypatch.delenv(distributed.ENV_PROCESS_ID, raising=False)
  with pytest.raises(ValueError, match="process_id=None"):
    spmd.initialize()
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
  with pytest.raises(ValueError, match="SPMD_NUM_PROCESSES='two' is not an integer"):
    spmd.initialize()
  with pytest.raises(ValueError, match="must be positive"):
    distributed._seconds(-1, distributed.ENV_HEARTBEAT, 100)


def test_timeouts_come_from_arguments_then_environment(monkeypatch):
  monkeypatch.setenv(distributed.ENV_HEARTBEAT, "2.5")
  assert distributed._seconds(None, distributed.ENV_HEARTBEAT, 100) == 2
  assert distributed._seconds(7, distributed.ENV_HEARTBEAT, 100) == 7
  monkeypatch.delenv(distributed.ENV_HEARTBEAT)
  assert distributed._seconds(None, distributed.ENV_HEARTBEAT, 100) == 100


def test_cpu_device_count_cannot_change_after_start():
  distributed.set_cpu_device_count(8)  # what the backend already has: fine
  with pytest.raises(RuntimeError, match="already started with 8 CPU devices"):
    distributed.set_cpu_device_count(4)
