"""Checks what spmd.initialize() set up, and where the coordinator listens."""

import itertools
import os
import socket
import sys

import spmd

info = spmd.initialize()
import jax  # noqa: E402

print(
  f"devices {jax.device_count()} local {jax.local_device_count()} processes {jax.process_count()}",
  flush=True,
)
if sys.argv[1:] == ["slurm"]:  # started by srun: JAX's SLURM detection did the rest
  assert info.process_index == int(os.environ["SLURM_PROCID"])
  sys.exit(0)
if sys.argv[1:] == ["k8s"]:  # a pod's command: the manifest's shell wrapper set the id
  expected = int(os.environ["EXPECTED_PROCESS_ID"])  # from the test, computed independently
  assert info.process_index == int(os.environ["SPMD_PROCESS_ID"]) == expected, (
    f"{info.process_index=} {os.environ['SPMD_PROCESS_ID']=} {expected=}"
  )
  print(f"k8s process {info.process_index}", flush=True)
  sys.exit(0)
if sys.argv[1:] == ["tpu"]:  # over (fake) gcloud ssh: the remote shell exported the id
  assert info.process_index == int(os.environ["SPMD_PROCESS_ID"])
  slices = int(os.environ.get("MEGASCALE_NUM_SLICES", "1"))
  slice_id = int(os.environ.get("MEGASCALE_SLICE_ID", "0"))
  # Process ids run slice by slice, as JAX numbers them on a multislice TPU job.
  assert slice_id == info.process_index // (info.process_count // slices), (slice_id, info)
  print(
    f"tpu process {info.process_index} slice {slice_id} of {slices} "
    f"megascale {os.environ.get('MEGASCALE_COORDINATOR_ADDRESS', '-')} "
    f"spmd from {os.path.dirname(os.path.dirname(spmd.__file__))}",
    flush=True,
  )
  sys.exit(0)
assert info.process_index == int(os.environ["SPMD_PROCESS_ID"])

if info.process_index == 0:
  port = int(os.environ["SPMD_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
  listening = []
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
      for row in f.read().splitlines()[1:]:
        fields = row.split()
        address, state = fields[1], fields[3]
        host, port_hex = address.rsplit(":", 1)
        if state == "0A" and int(port_hex, 16) == port:  # 0A = LISTEN
          listening.append(host)
  loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
  assert listening and set(listening) <= loopback, f"coordinator listens on {listening}"
  print("coordinator listens on loopback only", flush=True)
  # And from this host's other addresses, the port is closed.
  others = set()
  with open("/proc/net/fib_trie") as f:
    rows = f.read().splitlines()
  for above, row in itertools.pairwise(rows):
    if row.strip() == "/32 host LOCAL":  # the line above holds one of this host's addresses
      address = above.split()[-1]
      if not address.startswith("127."):
        others.add(address)
  for address in sorted(others):
    with socket.socket() as probe:
      probe.settimeout(5)
      try:
        probe.connect((address, port))
      except ConnectionRefusedError:
        print(f"coordinator refuses {address}", flush=True)
      else:
        raise AssertionError(f"the coordinator port {port} accepts connections on {address}")
  print(f"tried {len(others)} other addresses", flush=True)
