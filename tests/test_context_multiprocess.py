"""A `context` axis across processes: 2 processes x 2 devices train as the straight run.

The mesh is context=4: 2 inside each process and 2 across the two, so every
sequence is split 4 ways, half of it on each process, and attention's keys
and values cross them (the issue's 2 x 2; 1 x 4 is tests/test_context.py). Its first steps' losses must equal those of the shared
straight llama_tiny run (2 processes x 1 device, data=2, the sequence
whole), which it reads rather than trains: the same data order, the same
schedule (`train.steps` as there, stopped early by `train.stop_at_step`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multiprocess import ROOT, run_trainer
from tests.shared_runs import LLAMA_TINY_STEPS, llama_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 3


def test_a_context_axis_across_two_processes_trains_as_the_straight_run(tmp_path: Path):
  _, facts = llama_tiny_run()
  data = facts["data"]
  run = tmp_path / "run"
  result = run_trainer(
    [
      f"--config={ROOT / 'configs' / 'llama_tiny.py'}",
      f"--workdir={run}",
      f"--config.data.dir={data['dir']}",
      f"--config.data.source={data['source']}",
      "--config.data.validation_percent=25",  # the shared run's data, prepared once
      f"--config.train.steps={LLAMA_TINY_STEPS}",  # its schedule
      f"--config.train.stop_at_step={STEPS}",
      "--config.train.warmup_steps=5",
      "--config.log_every=1",
      "--config.eval_every=0",
      "--config.checkpoint.every=0",
      "--config.sample_tokens=0",
      "--config.mesh.ici=data=1,context=2",
      "--config.mesh.dcn=context=2",
    ],
    num_processes=2,
    devices_per_process=2,
    cache=data["cache"],
  )
  assert result.ok, result.report()
  output = result.processes[0].output
  assert "the sequence split over 4 context devices" in output, output
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
  assert sorted(losses) == list(range(1, STEPS + 1)), rows
  for step, loss in losses.items():
    assert loss == pytest.approx(facts["losses"][str(step)], rel=1e-5), (step, losses)
