"""A `context` axis across processes: 2 processes x 2 devices train as the straight run.

The mesh is context=4: 2 inside each process and 2 across the two, so every
sequence is split 4 ways, half of it on each process, and attention's keys
and values cross them (the issue's 2 x 2; 1 x 4 is tests/test_context.py). Saved there, the
run resumes on one process of 4 devices. Its first steps' losses must equal those of the shared
straight llama_tiny run (2 processes x 1 device, data=2, the sequence
whole), which it reads rather than trains: the same data order, the same
schedule (`train.steps` as there, stopped early by `train.stop_at_step`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.multiprocess import ROOT, run_trainer
from tests.shared_runs import LLAMA_TINY_STEPS, llama_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 4
SAVED = 2  # the 2 x 2 run saves here and stops; one process of 4 devices resumes


def _train(run: Path, data: dict, mesh: list[str], stop_at: int, processes: int, devices: int):
  result = run_trainer(
    [
      f"--config={ROOT / 'configs' / 'llama_tiny.py'}",
      f"--workdir={run}",
      f"--config.data.dir={data['dir']}",
      f"--config.data.source={data['source']}",
      "--config.data.validation_percent=25",  # the shared run's data, prepared once
      f"--config.train.steps={LLAMA_TINY_STEPS}",  # its schedule
      f"--config.train.stop_at_step={stop_at}",
      "--config.train.warmup_steps=5",
      "--config.log_every=1",
      "--config.eval_every=0",
      f"--config.checkpoint.every={SAVED}",
      "--config.sample_tokens=0",
      *mesh,
    ],
    num_processes=processes,
    devices_per_process=devices,
    cache=data["cache"],
  )
  assert result.ok, result.report()
  return result.processes[0].output


def test_a_context_axis_across_two_processes_trains_and_resumes_on_one_as_the_straight_run(
  tmp_path: Path,
):
  """2 x 2 with context=4 (2 in a process, 2 across) for SAVED steps, then 1 x 4 with context=4.

  The resumed run continues where the first stopped, its data position
  included, on another host count: every step's loss is the straight run's.
  """
  _, facts = llama_tiny_run()
  data, run = facts["data"], tmp_path / "run"
  across = ["--config.mesh.ici=data=1,context=2", "--config.mesh.dcn=context=2"]
  output = _train(run, data, across, SAVED, processes=2, devices=2)
  assert "the sequence split over 4 context devices" in output, output
  output = _train(run, data, ["--config.mesh.ici=data=1,context=4"], STEPS, 1, 4)
  assert re.search(rf"state from\s+: checkpoint step {SAVED}\n", output), output
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
  assert sorted(losses) == list(range(1, STEPS + 1)), rows
  for step, loss in losses.items():
    assert loss == pytest.approx(facts["losses"][str(step)], rel=1e-5), (step, losses)
