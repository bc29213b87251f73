"""`spmd-launch k8s`: a JobSet manifest that runs the job on GKE TPU slices or GPU nodes.

One replicatedJob, `workers`, with one Indexed Job per slice and one pod per
host. Every pod learns its place from two pod annotations through the
downward API: the JobSet job index (the slice) and the Job completion index
(the host within the slice). Kubernetes cannot do arithmetic in `env`, so the
container runs a tiny `sh` wrapper that sets `SPMD_PROCESS_ID = slice * hosts
+ host` and `exec`s the command. The command itself never passes through a
shell: it is the container's `args`, run as `"$@"`. The coordinator is the pod
of slice 0, host 0, at its stable JobSet DNS name `NAME-workers-0-0.NAME`.

Failure semantics match `spmd-launch local`: `backoffLimit: 0` fails a slice's
Job on any pod failure, and JobSet then restarts the whole set, up to
`failurePolicy.maxRestarts` times (the job resumes from its checkpoints);
except after a user error: a pod whose command exited 2
(`spmd.errors.EXIT_USER_ERROR`: a bad flag, config or path) fails its Job by
the Job's `podFailurePolicy`, and the JobSet's failure-policy rule for that
reason fails the whole set at once, since a restart would fail the same way.

Example:
  >>> m = jobset_manifest(["spmd-train", "--config=lm"], name="lm", image="img",
  ...                     tpu_type="v5p-64", num_slices=2)
  >>> job = m["spec"]["replicatedJobs"][0]
  >>> job["replicas"], job["template"]["spec"]["parallelism"]
  (2, 8)
  >>> pod = job["template"]["spec"]["template"]["spec"]
  >>> pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
  '2x4x4'
  >>> env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
  >>> env["SPMD_COORDINATOR_ADDRESS"], env["SPMD_NUM_PROCESSES"]
  ('lm-workers-0-0.lm:8476', '16')
  >>> pod["containers"][0]["args"]
  ['spmd-train', '--config=lm']
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence

import yaml

from launch.processes import ENV_NAME, env_assignment
from spmd import env_names, topology
from spmd.errors import EXIT_USER_ERROR

API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "workers"
# Downward-API sources, set on every pod by the JobSet and Job controllers.
JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
ENV_JOB_INDEX = "JOBSET_JOB_INDEX"
ENV_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"  # the Job controller's own name for it
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
DEFAULT_PORT = 8476  # JAX's usual coordinator port
DEFAULT_MEGASCALE_PORT = 8080  # libtpu's default

# GKE node label values (cloud.google.com/gke-tpu-accelerator) of multi-host
# capable TPU node pools, by generation.
_GKE_TPU_ACCELERATOR = {
  "v4": "tpu-v4-podslice",
  "v5p": "tpu-v5p-slice",
  "v5e": "tpu-v5-lite-podslice",
  "v6e": "tpu-v6e-slice",
}
_CHIPS_PER_HOST = 4  # every multi-host node pool of these generations (ct4p/ct5p/ct5lp/ct6e -4t)
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """What GKE needs to know about one TPU slice."""

  accelerator: str  # node label cloud.google.com/gke-tpu-accelerator
  topology: str  # node label cloud.google.com/gke-tpu-topology, e.g. "2x4x4"
  chips: int
  chips_per_host: int  # the pod's google.com/tpu request

  @property
  def hosts(self) -> int:
    return self.chips // self.chips_per_host


def tpu_slice(tpu_type: str) -> TpuSlice:
  """`v5p-64` -> 32 chips in a 2x4x4 torus on 8 hosts of 4 chips.

  Names follow Cloud TPU (see `spmd.topology`): v4 and v5p count TensorCores,
  v5e and v6e count chips; `v5p:2x4x4` names the shape directly.

  Example:
    >>> tpu_slice("v5p-64")
    TpuSlice(accelerator='tpu-v5p-slice', topology='2x4x4', chips=32, chips_per_host=4)
    >>> tpu_slice("v5e-16").hosts, tpu_slice("v6e-1").hosts
    (4, 1)
  """
  try:
    full = topology.topology_name(tpu_type)
  except ValueError as e:
    raise ValueError(f"{tpu_type=}: {e}") from None
  generation, _, shape = full.partition(":")
  if generation not in _GKE_TPU_ACCELERATOR:
    raise ValueError(
      f"{tpu_type=}: no GKE TPU node pool for {generation!r}; "
      f"known: {', '.join(sorted(_GKE_TPU_ACCELERATOR))}"
    )
  try:
    dims = [int(d) for d in shape.split("x")]
  except ValueError:
    raise ValueError(f"{tpu_type=}: the shape {shape!r} is not like 2x4x4") from None
  chips = math.prod(dims)
  three_d = len(topology.chip_grid(generation, 1)) == 3  # v4/v5p tori; v5e/v6e are 2-D
  if len(dims) != (3 if three_d else 2) or chips < 1:
    raise ValueError(f"{tpu_type=}: a {generation} shape has {3 if three_d else 2} sides")
  # GKE's smallest slices: 2x2x1 for v4/v5p; 1x1 or 2x2 for v5e/v6e. Larger
  # ones are whole hosts of 4 chips.
  if (three_d and chips < 4) or (chips != 1 and chips % _CHIPS_PER_HOST):
    raise ValueError(
      f"{tpu_type=} ({chips} chips): GKE slices are 1 chip or a multiple of "
      f"{_CHIPS_PER_HOST} (v4/v5p: at least 2x2x1)"
    )
  return TpuSlice(
    _GKE_TPU_ACCELERATOR[generation], "x".join(map(str, dims)), chips, min(chips, _CHIPS_PER_HOST)
  )


def coordinator_host(name: str) -> str:
  """The stable DNS name of slice 0, host 0: `<jobset>-<replicatedJob>-<job>-<pod>.<subdomain>`."""
  return f"{name}-{REPLICATED_JOB}-0-0.{name}"


def wrapper_script(hosts_per_slice: int) -> str:
  """The `sh` program each container runs before `exec`ing the command (its "$@").

  Only integers we computed appear in it; the command is never shell source.
  """
  return (
    "set -eu\n"
    "# process id = slice (JobSet job index) * hosts per slice + host (completion index)\n"
    f"export {env_names.ENV_PROCESS_ID}=$(( "
    f"${{{ENV_JOB_INDEX}:?}} * {hosts_per_slice} + ${{{ENV_COMPLETION_INDEX}:?}} ))\n"
    'exec "$@"\n'
  )


def kubelet_escape(text: str) -> str:
  """Escapes `text` for a container's command, args or env value.

  The kubelet expands `$(VAR)` there and turns `$$` into `$`; doubling every
  `$` makes it deliver `text` exactly.
  """
  return text.replace("$", "$$")


def _annotation_env(name: str, annotation: str) -> dict:
  return {
    "name": name,
    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{annotation}']"}},
  }


def jobset_manifest(
  command: Sequence[str],
  name: str,
  image: str,
  num_hosts: int | None = None,
  num_slices: int = 1,
  tpu_type: str | None = None,
  gpu_type: str | None = None,
  gpus_per_host: int = 0,
  namespace: str | None = None,
  max_restarts: int = 0,
  port: int = DEFAULT_PORT,
  megascale_port: int = DEFAULT_MEGASCALE_PORT,
  env: Mapping[str, str] | None = None,
) -> dict:
  """The JobSet, as a dict ready for `render`.

  Args:
    command: what every pod runs (e.g. spmd-train and its flags), verbatim.
    name: the JobSet's name; also its DNS subdomain.
    image: the container image; it needs `/bin/sh`.
    num_hosts: pods per slice. With `tpu_type`, derived from it (and checked
      when given); otherwise required.
    num_slices: slices (TPU multislice) or, without TPUs, groups of hosts;
      one Job each.
    tpu_type: a Cloud TPU slice name, e.g. v5p-64 or v5e-16.
    gpu_type: GKE's GPU node label value, e.g. nvidia-h100-80gb.
    gpus_per_host: `nvidia.com/gpu` each pod requests.
    namespace: the JobSet's namespace (kubectl's default when None).
    max_restarts: how many times JobSet restarts the whole set after a failure.
    port: the JAX coordinator's port on slice 0, host 0.
    megascale_port: libtpu's multislice (DCN) port.
    env: extra environment for every pod.
  """
  if not command:
    raise ValueError("the command to run is empty")
  _check_accelerators(tpu_type, gpu_type, gpus_per_host)
  tpu = tpu_slice(tpu_type) if tpu_type else None
  num_hosts = _hosts_per_slice(tpu, tpu_type, num_hosts)
  _check_job_shape(name, num_hosts, num_slices, max_restarts, port, megascale_port)
  container_env = _launcher_env(name, num_hosts, num_slices, port, megascale_port, tpu)
  container_env += _user_env(env, taken={e["name"] for e in container_env})
  container = {
    "name": "jax",
    "image": image,
    # sh -c SCRIPT NAME ARGS...: ARGS become the script's "$@", never shell source.
    "command": ["/bin/sh", "-c", kubelet_escape(wrapper_script(num_hosts)), "spmd-k8s"],
    "args": [kubelet_escape(a) for a in command],
    "env": container_env,
    "ports": [{"containerPort": port, "name": "coordinator"}],
  }
  pod_spec, annotations = _place_pods(container, tpu, gpu_type, gpus_per_host)
  return _jobset(name, namespace, annotations, num_slices, num_hosts, max_restarts, pod_spec)


def _check_accelerators(tpu_type: str | None, gpu_type: str | None, gpus_per_host: int) -> None:
  """A TPU slice, or GPUs with a count per pod, or neither; never both."""
  if tpu_type and (gpu_type or gpus_per_host):
    raise ValueError(f"give a TPU or GPUs, not both: {tpu_type=}, {gpu_type=}, {gpus_per_host=}")
  if gpu_type and gpus_per_host < 1:
    raise ValueError(
      f"{gpu_type=} needs --gpus-per-host (GPUs each pod requests); {gpus_per_host=}"
    )
  if gpus_per_host < 0:
    raise ValueError(f"{gpus_per_host=} must not be negative")


def _hosts_per_slice(tpu: TpuSlice | None, tpu_type: str | None, num_hosts: int | None) -> int:
  """Pods per slice: the TPU slice's hosts (checked against `num_hosts`), else `num_hosts`."""
  if tpu is not None:
    if num_hosts not in (None, tpu.hosts):
      raise ValueError(
        f"{tpu_type=} is {tpu.hosts} hosts of {tpu.chips_per_host} chips; got {num_hosts=}"
      )
    return tpu.hosts
  if num_hosts is None:
    raise ValueError("give --num-hosts (pods per slice), or a --tpu-type to derive it from")
  return num_hosts


def _check_job_shape(
  name: str, num_hosts: int, num_slices: int, max_restarts: int, port: int, megascale_port: int
) -> None:
  """Counts, ports and the JobSet's name are ones Kubernetes accepts."""
  if num_hosts < 1 or num_slices < 1:
    raise ValueError(f"{num_hosts=} and {num_slices=} must be at least 1")
  if max_restarts < 0:
    raise ValueError(f"{max_restarts=} must not be negative")
  for p in (port, megascale_port):
    if not 0 < p < 65536:
      raise ValueError(f"port {p} is not in 1..65535 ({port=}, {megascale_port=})")
  last_pod = f"{name}-{REPLICATED_JOB}-{num_slices - 1}-{num_hosts - 1}"
  if not _NAME.fullmatch(name) or len(last_pod) > 63:
    # Pod hostnames (and the subdomain) must be DNS labels: lowercase, at most 63.
    raise ValueError(
      f"{name=} must be lowercase letters, digits and '-', start with a letter, and keep "
      f"pod hostnames like {last_pod!r} within 63 characters"
    )


def _launcher_env(
  name: str,
  num_hosts: int,
  num_slices: int,
  port: int,
  megascale_port: int,
  tpu: TpuSlice | None,
) -> list[dict]:
  """What every pod needs to find its place in the job and reach the coordinator."""
  coordinator = coordinator_host(name)
  container_env = [
    _annotation_env(ENV_JOB_INDEX, JOB_INDEX_ANNOTATION),
    _annotation_env(ENV_COMPLETION_INDEX, COMPLETION_INDEX_ANNOTATION),
    {"name": env_names.ENV_NUM_PROCESSES, "value": str(num_slices * num_hosts)},
    {"name": env_names.ENV_COORDINATOR, "value": f"{coordinator}:{port}"},
  ]
  if tpu is not None and num_slices > 1:
    # libtpu's multislice (DCN) settings; JAX's own TPU detection reads them too.
    container_env += [
      {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": coordinator},
      {"name": "MEGASCALE_PORT", "value": str(megascale_port)},
      {"name": "MEGASCALE_NUM_SLICES", "value": str(num_slices)},
      _annotation_env("MEGASCALE_SLICE_ID", JOB_INDEX_ANNOTATION),
    ]
  return container_env


def _user_env(env: Mapping[str, str] | None, taken: set[str]) -> list[dict]:
  """The user's variables, sorted and escaped; none may replace one the launcher sets."""
  out = []
  for key, value in sorted((env or {}).items()):
    if not ENV_NAME.fullmatch(key) or key in taken:
      raise ValueError(
        f"environment variable {key!r} is not a valid name or is set by the launcher"
      )
    out.append({"name": key, "value": kubelet_escape(value)})
  return out


def _place_pods(
  container: dict, tpu: TpuSlice | None, gpu_type: str | None, gpus_per_host: int
) -> tuple[dict, dict]:
  """The pod spec with its accelerator requests and node selectors, and the JobSet's annotations."""
  pod_spec: dict = {"restartPolicy": "Never", "containers": [container]}
  annotations = {}
  if tpu is not None:
    container["resources"] = {"limits": {"google.com/tpu": tpu.chips_per_host}}
    pod_spec["nodeSelector"] = {
      "cloud.google.com/gke-tpu-accelerator": tpu.accelerator,
      "cloud.google.com/gke-tpu-topology": tpu.topology,
    }
    # As in GKE's multislice examples: DCN traffic skips the pod network.
    pod_spec["hostNetwork"] = True
    pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    # One Job per node pool: a slice's hosts share one ICI domain, and two
    # slices never share one.
    annotations[EXCLUSIVE_TOPOLOGY] = "cloud.google.com/gke-nodepool"
  elif gpus_per_host:
    container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_host}}
    if gpu_type:
      pod_spec["nodeSelector"] = {"cloud.google.com/gke-accelerator": gpu_type}
  return pod_spec, annotations


def _jobset(
  name: str,
  namespace: str | None,
  annotations: dict,
  num_slices: int,
  num_hosts: int,
  max_restarts: int,
  pod_spec: dict,
) -> dict:
  """One replicated Indexed Job of `num_hosts` pods per slice, restarted together."""
  metadata: dict = {"name": name}
  if namespace:
    metadata["namespace"] = namespace
  if annotations:
    metadata["annotations"] = annotations
  return {
    "apiVersion": API_VERSION,
    "kind": "JobSet",
    "metadata": metadata,
    "spec": {
      # A headless Service named `name`: pods resolve as <pod hostname>.<name>.
      "network": {"enableDNSHostnames": True, "subdomain": name},
      # Any failed Job restarts the whole set, up to maxRestarts; then it fails.
      # A Job failed by its podFailurePolicy (a user error, below) fails it now.
      "failurePolicy": {
        "maxRestarts": max_restarts,
        "rules": [
          {
            "name": "failOnUserError",
            "action": "FailJobSet",
            "onJobFailureReasons": ["PodFailurePolicy"],
          }
        ],
      },
      "replicatedJobs": [
        {
          "name": REPLICATED_JOB,
          "replicas": num_slices,
          "template": {
            "spec": {
              "completionMode": "Indexed",
              "parallelism": num_hosts,
              "completions": num_hosts,
              "backoffLimit": 0,  # one failed pod fails the Job (fail fast)
              "podFailurePolicy": {
                "rules": [
                  {
                    "action": "FailJob",
                    "onExitCodes": {
                      "containerName": pod_spec["containers"][0]["name"],
                      "operator": "In",
                      "values": [EXIT_USER_ERROR],
                    },
                  }
                ]
              },
              "template": {"spec": pod_spec},
            }
          },
        }
      ],
    },
  }


class _Dumper(yaml.SafeDumper):
  """Multi-line strings (the wrapper script) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
  style = "|" if "\n" in data else None
  return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def render(manifest: dict) -> str:
  """The manifest as YAML, for `kubectl apply -f`."""
  header = (
    "# Written by spmd-launch k8s. In command, args and env values `$$` is\n"
    "# Kubernetes' escape for `$`: the container sees the text unchanged.\n"
  )
  return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def apply(text: str) -> str:
  """Pipes the manifest to `kubectl apply -f -`; returns kubectl's answer."""
  try:
    done = subprocess.run(
      ["kubectl", "apply", "-f", "-"], input=text, capture_output=True, text=True, check=False
    )
  except FileNotFoundError:
    raise RuntimeError("kubectl is not on PATH; write the manifest with --output instead") from None
  if done.returncode:
    raise RuntimeError(f"kubectl apply failed ({done.returncode}): {done.stderr.strip()}")
  return done.stdout.strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The `spmd-launch k8s` flags."""
  parser.add_argument("--name", required=True, help="JobSet name (and DNS subdomain)")
  parser.add_argument("--image", required=True, help="container image (needs /bin/sh)")
  parser.add_argument(
    "--num-hosts", type=int, default=None, help="pods per slice (derived from --tpu-type)"
  )
  parser.add_argument("--num-slices", type=int, default=1, help="TPU slices (one Job each)")
  parser.add_argument("--tpu-type", default=None, help="e.g. v5p-64, v5e-16, v6e-256")
  parser.add_argument("--gpu-type", default=None, help="GKE GPU label, e.g. nvidia-h100-80gb")
  parser.add_argument("--gpus-per-host", type=int, default=0)
  parser.add_argument("--namespace", default=None)
  parser.add_argument(
    "--max-restarts", type=int, default=0, help="JobSet restarts of the whole set after a failure"
  )
  parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="JAX coordinator port")
  parser.add_argument("--megascale-port", type=int, default=DEFAULT_MEGASCALE_PORT)
  parser.add_argument(
    "--env", type=env_assignment, action="append", default=[], help="KEY=VALUE for every pod"
  )
  parser.add_argument("--output", default=None, help="write the manifest here (default: stdout)")
  parser.add_argument("--apply", action="store_true", help="pipe it to kubectl apply -f -")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program args...")


def task_folder_note(command: Sequence[str], image: str) -> str:
  """How to get a task folder that lives on this machine into the pods, if one is named.

  Pods see only their image, so a `--config=` outside the checkout that the
  image was built from has to be built into the image.

  Example:
    >>> task_folder_note(["spmd-train", "--config=configs/lm_tiny.py"], "img")
    ''
  """
  for arg in command:
    path = arg.split("=", 1)[1] if arg.startswith("--config=") else ""
    if path and os.path.isabs(path) and os.path.exists(path):
      folder = os.path.dirname(path)
      name = os.path.basename(folder)
      return (
        f"{arg} is a file on this machine; the pods see only the image {image!r}. Build the "
        f"folder into it (a Dockerfile of two lines: 'FROM {image}' and "
        f"'COPY {name} /home/spmd/{name}', built in {os.path.dirname(folder)}) and pass "
        f"--config=/home/spmd/{name}/{os.path.basename(path)}"
      )
  return ""


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """Writes the manifest (to --output or stdout) and with --apply hands it to kubectl."""
  try:
    text = render(
      jobset_manifest(
        command,
        args.name,
        args.image,
        num_hosts=args.num_hosts,
        num_slices=args.num_slices,
        tpu_type=args.tpu_type,
        gpu_type=args.gpu_type,
        gpus_per_host=args.gpus_per_host,
        namespace=args.namespace,
        max_restarts=args.max_restarts,
        port=args.port,
        megascale_port=args.megascale_port,
        env=dict(args.env),
      )
    )
  except ValueError as e:
    print(f"spmd-launch k8s: {e}", file=sys.stderr)
    return 2
  note = task_folder_note(command, args.image)
  if note:
    print(f"spmd-launch k8s: note: {note}", file=sys.stderr)
  if args.output:
    with open(args.output, "w") as f:
      f.write(text)
    print(f"spmd-launch k8s: wrote {args.output}", file=sys.stderr)
  elif not args.apply:
    sys.stdout.write(text)
  if args.apply:
    try:
      print(f"spmd-launch k8s: {apply(text)}")
    except RuntimeError as e:
      print(f"spmd-launch k8s: {e}", file=sys.stderr)
      return 1
  return 0
