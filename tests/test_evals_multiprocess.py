"""`config.evals` across processes: in a 2 x 2 run, then by --mode=eval on 1 x 4 and 4 x 1.

The run starts from the shared llama_tiny run's weights (`checkpoint.init_from`,
no training of its own beyond 2 steps: the evals need a model that has
learned something, not a run of their own) with `examples/evals/config.py`'s
two evals, a multiple-choice one and a generation one, every step. Then the
saved step is evaluated alone on 1 process x 4 devices and 4 x 1: every
process reads the whole file and places only its devices' rows, so a row
scored twice or not at all, or a process that placed another's rows, would
move the scores. They must equal the run's own at that step (the
log-likelihood to float32 rounding), and so must the loss eval's metrics,
and the completions file must be the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multiprocess import ROOT, run_trainer
from tests.shared_runs import llama_tiny_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

CONFIG = str(ROOT / "examples" / "evals" / "config.py")
STEPS = 2
# Seconds and rates differ from run to run; the rest must not.
TIMED = ("seconds", "tokens_per_s")


def _launch(data: dict, args: list[str], processes: int, devices: int):
  result = run_trainer(
    args, num_processes=processes, devices_per_process=devices, cache=data["cache"]
  )
  assert result.ok, result.report()
  return result


# The loss eval beside them (`config.eval_every`), on the same eval batches.
LOSS_EVAL = ("eval_loss", "eval_accuracy", "eval_weight")


def _evals(record: dict) -> dict[str, float]:
  return {
    k: v
    for k, v in record.items()
    if (k.startswith("evals/") and k.rsplit("/", 1)[1] not in TIMED) or k in LOSS_EVAL
  }


def test_evals_of_a_2x2_run_equal_eval_only_on_1x4_and_4x1(tmp_path: Path):
  shared, facts = llama_tiny_run()
  data = facts["data"]
  run = tmp_path / "run"
  _launch(
    data,
    [
      f"--config={CONFIG}",
      f"--workdir={run}",
      f"--config.data.dir={data['dir']}",
      f"--config.data.source={data['source']}",
      "--config.data.validation_percent=25",  # the shared run's data, prepared once
      f"--config.checkpoint.init_from={shared / 'run'}",
      f"--config.train.steps={STEPS}",
      "--config.train.warmup_steps=1",
      "--config.eval_every=1",
      "--config.eval_batches=1",
      "--config.log_every=1",
      "--config.sample_tokens=0",
    ],
    processes=2,
    devices=2,
  )
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  in_run: dict[int, dict] = {}
  for r in rows:  # the evals' and the loss eval's rows of each step
    if _evals(r):
      in_run.setdefault(r["step"], {}).update(_evals(r))
  assert sorted(in_run) == [1, 2], rows  # every eval_every step, beside the loss eval
  final = in_run[STEPS]
  assert final["evals/code/items"] == 8 and final["evals/complete/items"] == 5, final
  assert set(LOSS_EVAL) <= final.keys(), final
  assert final["evals/complete/answered"] == 3 and "evals/complete/exact_match" in final
  # Each eval reads the state of its step, not the first one's.
  first = in_run[1]["evals/code/answer_loglikelihood"]
  assert first != final["evals/code/answer_loglikelihood"], in_run
  completions = (run / "evals" / "complete" / f"step_{STEPS}.jsonl").read_bytes()
  assert len(completions.splitlines()) == 5

  for processes, devices in ((1, 4), (4, 1)):
    result = _launch(data, ["--mode=eval", f"--workdir={run}"], processes, devices)
    assert "evals/code/acc_norm" in result.processes[0].output, result.report()
    alone = json.loads((run / "eval" / f"step_{STEPS}.json").read_text())
    assert alone["processes"] == processes
    got = _evals(alone)
    assert got.keys() == final.keys(), (processes, devices)
    for key, value in final.items():
      assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (processes, devices, key)
    again = (run / "evals" / "complete" / f"step_{STEPS}.jsonl").read_bytes()
    assert again == completions, (processes, devices)
