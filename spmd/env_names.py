"""The environment variables our launchers set for each process, and `spmd.initialize` reads.

A module of its own, with no JAX import, so that the launchers (`launch/`),
which only start processes, do not pay for importing JAX.

Example:
  >>> from spmd import env_names
  >>> env_names.ENV_PROCESS_ID
  'SPMD_PROCESS_ID'
"""

ENV_COORDINATOR = "SPMD_COORDINATOR_ADDRESS"
ENV_BIND = "SPMD_COORDINATOR_BIND_ADDRESS"
ENV_NUM_PROCESSES = "SPMD_NUM_PROCESSES"
ENV_PROCESS_ID = "SPMD_PROCESS_ID"
ENV_CPU_DEVICES = "SPMD_CPU_DEVICES"
ENV_HEARTBEAT = "SPMD_HEARTBEAT_TIMEOUT_S"
ENV_SHUTDOWN = "SPMD_SHUTDOWN_TIMEOUT_S"
ENV_INIT = "SPMD_INIT_TIMEOUT_S"
