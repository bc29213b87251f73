"""An `expert` axis across processes: 4 x 1, 2 x 2 and 1 x 4 train a routed Llama as the straight run.

The routed llama_tiny (4 experts, top 2) trains on 4 processes of 1 device
with expert=4 across them (one expert a process) to step 2; the run resumes
on 2 processes of 2 devices with expert=4, 2 inside each process and 2
across the two, to step 3; then on one process of 4 devices with data=2 x
expert=2 (two experts a device) to step 4. Across processes the tokens of
each layer cross to their experts and back. Every step's loss equals that
of a straight run on one device (every expert there, no collectives) over
the same data in the same order, so the split, the host count and the
resumes change nothing, the data position included. Its own straight run,
not a shared one: the shared runs (tests/shared_runs.py) are dense; it
reads their prepared data.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.multiprocess import ROOT, run_trainer
from tests.shared_runs import llama_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 4
# Each leg of the resumed run stops (and saves: checkpoint.every=1) here; the next resumes.
LEGS = (  # (stop at, processes, devices a process, mesh)
  (2, 4, 1, ["--config.mesh.ici=data=1,expert=1", "--config.mesh.dcn=expert=4"]),
  (3, 2, 2, ["--config.mesh.ici=data=1,expert=2", "--config.mesh.dcn=expert=2"]),
  (4, 1, 4, ["--config.mesh.ici=data=2,expert=2"]),
)
ROUTED = (
  "--config.model.moe_experts=4",
  "--config.model.moe_top_k=2",
  "--config.model.moe_d_ff=64",
  "--config.global_batch=8",
)


def _train(run: Path, data: dict, mesh: list[str], stop_at: int, processes: int, devices: int):
  result = run_trainer(
    [
      f"--config={ROOT / 'configs' / 'llama_tiny.py'}",
      f"--workdir={run}",
      f"--config.data.dir={data['dir']}",
      f"--config.data.source={data['source']}",
      "--config.data.validation_percent=25",  # the shared run's data, prepared once
      f"--config.train.steps={STEPS}",
      f"--config.train.stop_at_step={stop_at}",
      "--config.train.warmup_steps=2",
      "--config.log_every=1",
      "--config.eval_every=0",
      "--config.eval_batches=1",  # the run's closing eval: one batch
      "--config.checkpoint.every=1",
      "--config.sample_tokens=0",
      *ROUTED,
      *mesh,
    ],
    num_processes=processes,
    devices_per_process=devices,
    cache=data["cache"],
  )
  assert result.ok, result.report()
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  return result.processes[0].output, {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_an_expert_axis_on_4x1_2x2_and_1x4_trains_and_resumes_as_the_straight_run(
  tmp_path: Path,
):
  """Straight: 1 x 1. Split: the LEGS in turn, each resuming the one before."""
  _, facts = llama_tiny_run()
  data = facts["data"]
  _, straight = _train(tmp_path / "straight", data, ["--config.mesh.ici=data=1"], STEPS, 1, 1)
  run = tmp_path / "run"
  resumed_from = 0
  for stop_at, processes, devices, mesh in LEGS:
    output, losses = _train(run, data, mesh, stop_at, processes, devices)
    if resumed_from:
      assert re.search(rf"state from\s+: checkpoint step {resumed_from}\n", output), output
    resumed_from = stop_at
  assert sorted(losses) == sorted(straight) == list(range(1, STEPS + 1)), (losses, straight)
  for step, loss in losses.items():
    assert loss == pytest.approx(straight[step], rel=1e-5), (step, losses, straight)
