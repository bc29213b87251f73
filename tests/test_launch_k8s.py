"""spmd-launch k8s: the JobSet manifest, parsed back, and its pods' commands run here."""

import os
import re
import subprocess
import sys

import pytest
import yaml

from launch import k8s, launch_cli
from launch.local import free_port
from tests.multiprocess import ROOT, WORKERS

PY = sys.executable
FIELD_PATH = re.compile(r"metadata\.annotations\['([^']+)'\]")


def write_manifest(tmp_path, *flags, command=(PY, "-c", "pass")):
  """Runs `spmd-launch k8s FLAGS --output FILE -- COMMAND` and parses FILE back."""
  path = tmp_path / "jobset.yaml"
  argv = ["k8s", "--name", "t", "--image", "img", *flags, "--output", str(path), "--", *command]
  assert launch_cli.main(argv) == 0
  return yaml.safe_load(path.read_text())


def job_spec(manifest):
  return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]


def container(manifest):
  return job_spec(manifest)["template"]["spec"]["containers"][0]


def kubelet_expand(text, env):
  """What the kubelet does to command, args and env values: `$(VAR)` and `$$`."""
  out, i = [], 0
  while i < len(text):
    if text[i] != "$" or i + 1 == len(text):
      out.append(text[i])
      i += 1
    elif text[i + 1] == "$":
      out.append("$")
      i += 2
    elif text[i + 1] == "(" and (close := text.find(")", i + 2)) != -1:
      name = text[i + 2 : close]
      out.append(env.get(name, text[i : close + 1]))  # unknown references stay as written
      i = close + 1
    else:
      out.append(text[i : i + 2])
      i += 2
  return "".join(out)


def pod_process(manifest, job_index, completion_index, local_coordinator=False):
  """The argv and environment the pod (job_index, completion_index) would start with."""
  annotations = {
    "jobset.sigs.k8s.io/job-index": str(job_index),
    "batch.kubernetes.io/job-completion-index": str(completion_index),
  }
  env = {}
  for entry in container(manifest).get("env", []):
    if "value" in entry:
      env[entry["name"]] = kubelet_expand(entry["value"], env)
    else:  # the downward API; any other source fails the test here
      field_path = entry["valueFrom"]["fieldRef"]["fieldPath"]
      env[entry["name"]] = annotations[FIELD_PATH.fullmatch(field_path).group(1)]
  if local_coordinator:
    # The only substitution: slice 0 host 0's DNS name becomes this machine.
    host = k8s.coordinator_host(manifest["metadata"]["name"])
    env = {k: v.replace(host, "127.0.0.1") for k, v in env.items()}
  c = container(manifest)
  argv = [kubelet_expand(a, env) for a in c["command"] + c.get("args", [])]
  return argv, env


def base_env(**extra):
  """The image's environment, standing in for the container's: this venv, CPU JAX."""
  env = dict(os.environ)
  for name in ("SPMD_COORDINATOR_ADDRESS", "SPMD_NUM_PROCESSES", "SPMD_PROCESS_ID"):
    env.pop(name, None)  # inherited ones; the pod's own come from `extra`
  env.update(
    PYTHONPATH=str(ROOT),
    JAX_PLATFORMS="cpu",
    SPMD_CPU_DEVICES="2",
    SPMD_HEARTBEAT_TIMEOUT_S="5",
    SPMD_SHUTDOWN_TIMEOUT_S="5",
  )
  env.update(extra)
  return env


def run_pods(manifest, timeout_s, local_coordinator=False):
  """Starts every pod's command at once; returns [(slice, host, returncode, output)]."""
  slices = manifest["spec"]["replicatedJobs"][0]["replicas"]
  hosts = job_spec(manifest)["completions"]
  pods = []
  for s in range(slices):
    for h in range(hosts):
      argv, env = pod_process(manifest, s, h, local_coordinator)
      # The test's own expectation, computed here, not taken from the wrapper.
      env = base_env(**env, EXPECTED_PROCESS_ID=str(s * hosts + h))
      proc = subprocess.Popen(
        ["timeout", "-k", "5", str(timeout_s), *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
      )
      pods.append((s, h, proc))
  results = []
  for s, h, proc in pods:
    out, _ = proc.communicate(timeout=timeout_s + 15)  # timeout -k ends it well before
    results.append((s, h, proc.returncode, out))
  return results


def test_tpu_multislice_manifest(tmp_path):
  m = write_manifest(
    tmp_path,
    *("--tpu-type", "v5p-64", "--num-slices", "2", "--max-restarts", "3", "--namespace", "ml"),
  )
  assert (m["apiVersion"], m["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  assert m["metadata"]["namespace"] == "ml"
  assert m["metadata"]["annotations"] == {
    "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
  }
  spec = m["spec"]
  assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "t"}
  # Restarts after a failure, but never after a user error (exit 2): that fails the set.
  assert spec["failurePolicy"] == {
    "maxRestarts": 3,
    "rules": [
      {
        "name": "failOnUserError",
        "action": "FailJobSet",
        "onJobFailureReasons": ["PodFailurePolicy"],
      }
    ],
  }
  (rjob,) = spec["replicatedJobs"]
  assert (rjob["name"], rjob["replicas"]) == ("workers", 2)
  job = job_spec(m)
  # v5p-64: 64 TensorCores = 32 chips = 8 hosts of 4 chips.
  assert job["completionMode"] == "Indexed"
  assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (8, 8, 0)
  assert job["podFailurePolicy"] == {
    "rules": [
      {
        "action": "FailJob",
        "onExitCodes": {"containerName": "jax", "operator": "In", "values": [2]},
      }
    ]
  }
  pod = job["template"]["spec"]
  assert pod["restartPolicy"] == "Never"
  assert pod["nodeSelector"] == {
    "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
    "cloud.google.com/gke-tpu-topology": "2x4x4",
  }
  c = container(m)
  assert c["image"] == "img"
  assert c["resources"] == {"limits": {"google.com/tpu": 4}}
  env = {e["name"]: e for e in c["env"]}
  assert env["SPMD_NUM_PROCESSES"]["value"] == "16"
  assert env["SPMD_COORDINATOR_ADDRESS"]["value"] == "t-workers-0-0.t:8476"
  assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "t-workers-0-0.t"
  assert env["MEGASCALE_NUM_SLICES"]["value"] == "2"
  assert env["MEGASCALE_PORT"]["value"] == "8080"
  annotation = "metadata.annotations['{}']".format
  for name, source in [
    ("JOBSET_JOB_INDEX", "jobset.sigs.k8s.io/job-index"),
    ("MEGASCALE_SLICE_ID", "jobset.sigs.k8s.io/job-index"),
    ("JOB_COMPLETION_INDEX", "batch.kubernetes.io/job-completion-index"),
  ]:
    assert env[name]["valueFrom"] == {"fieldRef": {"fieldPath": annotation(source)}}
  assert "SPMD_PROCESS_ID" not in env  # the wrapper computes it


def test_gpu_manifest_on_stdout(capsys):
  argv = ["k8s", "--name", "g", "--image", "img", "--gpu-type", "nvidia-h100-80gb"]
  argv += ["--gpus-per-host", "8", "--num-hosts", "4", "--", "spmd-train"]
  assert launch_cli.main(argv) == 0
  m = yaml.safe_load(capsys.readouterr().out)
  pod = job_spec(m)["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
  assert container(m)["resources"] == {"limits": {"nvidia.com/gpu": 8}}
  assert job_spec(m)["parallelism"] == 4 and m["spec"]["replicatedJobs"][0]["replicas"] == 1
  names = {e["name"] for e in container(m)["env"]}
  assert "MEGASCALE_NUM_SLICES" not in names and "hostNetwork" not in pod
  assert "annotations" not in m["metadata"] and container(m)["args"] == ["spmd-train"]


@pytest.mark.multiprocess
def test_every_pod_computes_its_process_id(tmp_path):
  # v5e-8: 2 hosts of 4 chips; 3 slices make 6 processes.
  code = "import os; print(os.environ['SPMD_PROCESS_ID'], os.environ['MEGASCALE_SLICE_ID'])"
  m = write_manifest(tmp_path, "--tpu-type", "v5e-8", "--num-slices", "3", command=(PY, "-c", code))
  results = run_pods(m, timeout_s=30)
  assert all(rc == 0 for *_, rc, _ in results), results
  seen = {(s, h): out.split() for s, h, _, out in results}
  assert seen == {(s, h): [str(2 * s + h), str(s)] for s in range(3) for h in range(2)}


@pytest.mark.multiprocess
def test_a_pod_without_its_index_fails_loudly(tmp_path):
  m = write_manifest(tmp_path, "--num-hosts", "2")
  argv, env = pod_process(m, 0, 1)
  env["JOBSET_JOB_INDEX"] = ""  # as if the annotation were missing
  done = subprocess.run(
    ["timeout", "-k", "5", "30", *argv], env=base_env(**env), capture_output=True, text=True
  )
  assert done.returncode != 0 and "JOBSET_JOB_INDEX" in done.stderr


@pytest.mark.multiprocess
def test_pods_form_a_multi_process_jax_job(tmp_path):
  m = write_manifest(
    tmp_path,
    *("--num-slices", "2", "--num-hosts", "1", "--port", str(free_port())),
    command=(PY, str(WORKERS / "init_worker.py"), "k8s"),
  )
  results = run_pods(m, timeout_s=120, local_coordinator=True)
  report = "\n".join(f"--- pod {s}-{h}: exit {rc}\n{out}" for s, h, rc, out in results)
  assert all(rc == 0 for *_, rc, _ in results), report
  assert all("devices 4 local 2 processes 2" in out for *_, out in results), report
  ids = sorted(int(i) for *_, out in results for i in re.findall(r"k8s process (\d+)", out))
  assert ids == [0, 1], report


@pytest.mark.multiprocess
def test_apply_pipes_the_manifest_to_kubectl(tmp_path, monkeypatch, capsys):
  fake = tmp_path / "kubectl"
  fake.write_text(
    f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'argv'}\ncat > {tmp_path / 'stdin'}\n"
    'echo "jobset.jobset.x-k8s.io/t created"\nexit "${FAKE_KUBECTL_RC:-0}"\n'
  )
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  argv = ["k8s", "--name", "t", "--image", "img", "--num-hosts", "2", "--apply", "--", "x"]
  assert launch_cli.main(argv) == 0
  assert (tmp_path / "argv").read_text().split() == ["apply", "-f", "-"]
  assert yaml.safe_load((tmp_path / "stdin").read_text())["kind"] == "JobSet"
  assert "jobset.jobset.x-k8s.io/t created" in capsys.readouterr().out
  monkeypatch.setenv("FAKE_KUBECTL_RC", "1")
  assert launch_cli.main(argv) == 1
  assert "kubectl apply failed (1)" in capsys.readouterr().err


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--tpu-type", "v9-64"], "tpu_type='v9-64': unknown TPU slice 'v9-64'"),
    (["--tpu-type", "v5p-4"], "tpu_type='v5p-4'"),
    (["--num-hosts", "0"], "num_hosts=0 and num_slices=1 must be at least 1"),
    (["--tpu-type", "v5p-64", "--num-hosts", "4"], "8 hosts of 4 chips; got num_hosts=4"),
    (["--tpu-type", "v5e-16", "--gpu-type", "nvidia-l4"], "give a TPU or GPUs, not both"),
    (["--gpu-type", "nvidia-l4", "--num-hosts", "1"], "needs --gpus-per-host"),
    ([], "give --num-hosts"),
    (["--num-hosts", "1", "--name", "Bad_Name"], "name='Bad_Name' must be lowercase"),
    (["--num-hosts", "1", "--port", "0"], "port 0 is not in 1..65535"),
  ],
)
def test_bad_input_gets_clear_errors(flags, message, capsys):
  argv = ["k8s", "--name", "t", "--image", "img", *flags, "--", "x"]
  assert launch_cli.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err, err


def test_a_task_folder_on_this_machine_gets_a_note_on_building_it_into_the_image(tmp_path, capsys):
  folder = tmp_path / "my_cnn"
  folder.mkdir()
  (folder / "config.py").write_text("# a user's config\n")
  argv = ["k8s", "--name", "c", "--image", "harness:tpu", "--tpu-type", "v5p-8"]
  argv += ["--", "spmd-train", f"--config={folder / 'config.py'}", "--workdir=gs://b/run"]
  assert launch_cli.main(argv) == 0
  err = capsys.readouterr().err
  assert "the pods see only the image 'harness:tpu'" in err, err
  assert "'COPY my_cnn /home/spmd/my_cnn'" in err and "--config=/home/spmd/my_cnn/config.py" in err
