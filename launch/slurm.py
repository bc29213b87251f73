"""`spmd-launch slurm`: an sbatch script that runs the job with one `srun` line.

srun starts one process per task (per node, or per GPU); each process's
`spmd.initialize()` finds SLURM's environment and lets JAX's own SLURM
detection pick the coordinator (the first node), the process count and id.
`--kill-on-bad-exit=1` makes one task's failure end the whole step: whatever
the cluster's KillOnBadExit, the others do not wait out a heartbeat timeout
or a collective that never completes, holding the allocation.
Everything user-supplied reaches the script through `shlex.quote`.

Example:
  >>> print(sbatch_script(["spmd-train", "--workdir=run; rm -rf ~"], nodes=2,
  ...                     tasks_per_node=1, job_name="lm"), end="")
  #!/bin/bash
  #SBATCH --job-name=lm
  #SBATCH --nodes=2
  #SBATCH --ntasks-per-node=1
  set -euo pipefail
  srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 spmd-train '--workdir=run; rm -rf ~'
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence


def sbatch_script(
  command: Sequence[str],
  nodes: int,
  tasks_per_node: int = 1,
  gpus_per_node: int = 0,
  time_limit: str = "",
  job_name: str = "spmd",
  partition: str = "",
  output: str = "",
  env: dict[str, str] | None = None,
  heartbeat_timeout_s: float = 0,
) -> str:
  """The sbatch script text.

  Args:
    command: what every task runs (e.g. spmd-train and its flags).
    nodes: nodes to allocate.
    tasks_per_node: processes per node (1 per node, or 1 per GPU).
    gpus_per_node: GPUs to request per node (0: none requested).
    time_limit: sbatch --time, e.g. "04:00:00".
    job_name, partition, output: the usual sbatch settings.
    env: extra environment exported before srun.
    heartbeat_timeout_s: JAX heartbeat timeout for the job (0: JAX's default).
  """
  if nodes < 1 or tasks_per_node < 1:
    raise ValueError(f"{nodes=} and {tasks_per_node=} must be at least 1")
  if not command:
    raise ValueError("the command to run is empty")
  lines = [
    "#!/bin/bash",
    f"#SBATCH --job-name={shlex.quote(job_name)}",
    f"#SBATCH --nodes={nodes}",
    f"#SBATCH --ntasks-per-node={tasks_per_node}",
  ]
  if gpus_per_node:
    lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
  if time_limit:
    lines.append(f"#SBATCH --time={shlex.quote(time_limit)}")
  if partition:
    lines.append(f"#SBATCH --partition={shlex.quote(partition)}")
  if output:
    lines.append(f"#SBATCH --output={shlex.quote(output)}")
  lines += ["set -euo pipefail"]
  exports = dict(env or {})
  if heartbeat_timeout_s:
    exports["SPMD_HEARTBEAT_TIMEOUT_S"] = str(heartbeat_timeout_s)
  lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(exports.items())]
  srun = f"srun --nodes={nodes} --ntasks-per-node={tasks_per_node} --kill-on-bad-exit=1"
  lines.append(f"{srun} {shlex.join(command)}")
  return "\n".join(lines) + "\n"


def write_and_maybe_submit(script: str, path: str, submit: bool) -> str:
  """Writes the script; with `submit`, hands it to sbatch and returns its answer."""
  with open(path, "w") as f:
    f.write(script)
  if not submit:
    return f"wrote {path}; submit it with: sbatch {shlex.quote(path)}"
  done = subprocess.run(["sbatch", path], capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"sbatch {path} failed ({done.returncode}): {done.stderr.strip()}")
  return done.stdout.strip()
