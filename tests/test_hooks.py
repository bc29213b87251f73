"""Hooks: scheduled where registered, run on every process, no host sync they did not ask for.

The end-to-end test registers two hooks from `config.hooks` (a file beside a
config file outside the checkout) and trains 2 processes x 2 devices with
the transfer guard on. Each hook records, per process, the steps it ran at,
whether it got metrics, and how many metric rows had been fetched: before
the metrics hook's first fetch (log_every=5) none had, so the loop synced
with the host for no one at steps 1-3. The same factory returns a `Wrapper`
(a check of each process's own rows, and a count of the train step's calls)
and a hook whose `end` puts both counts in the run's summary.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from launch.local import run_local
from tests.multiprocess import ROOT
from trainers.hooks import Hook, Wrapper, load_hooks, resolve_hook_specs

HOOKS = """
import json

import jax

from trainers.hooks import Hook, Wrapper

_seen = {"steps": [], "rows": 0, "calls": 0}


def _check_rows(step, rows):
  # A data check of the user's own: every process sees its own rows, as numpy.
  if rows["inputs"].dtype.kind != "i" or rows["inputs"].ndim != 2:
    raise ValueError(f"step {step}: inputs {rows['inputs'].dtype} {rows['inputs'].shape}")
  _seen["steps"].append(step)
  _seen["rows"] += len(rows["inputs"])
  return rows


def _counted(step_fn, context):
  assert context.first_step == 0 and callable(context.build)

  def run(state, batch):
    _seen["calls"] += 1
    return step_fn(state, batch)

  return run


def _counts(info, ok):
  steps = sorted(set(_seen["steps"]))
  return {"rows_checked": _seen["rows"], "step_calls": _seen["calls"], "first_steps": steps[:9]}


def _record(name):
  def run(info):
    row = {
      "hook": name,
      "step": info.step,
      "metrics": None if info.metrics is None else info.metrics["loss"],
      "fetched": len(info.history),
      "params": sorted(info.state["params"])[:1],
    }
    with open(f"{info.workdir}/hooks_p{jax.process_index()}.jsonl", "a") as f:
      f.write(json.dumps(row) + "\\n")

  return run


def make(config):
  return [
    Hook(_record("plain"), every=3),
    Hook(_record("wants_metrics"), every=4, metrics=True),
    Wrapper(host_rows=_check_rows, train_step=_counted, name="checks"),
    Hook(lambda info: None, end=_counts, name="counts"),
  ]
"""

CONFIG = """
from tests.configs import train_tiny


def get_config():
  config = train_tiny.get_config()
  config.hooks = ("hooks.py:make",)
  return config
"""


def test_hook_schedules_and_checks():
  hook = Hook(print, every=4, at=(1,))
  assert [s for s in range(1, 11) if hook.due(s, 10)] == [1, 4, 8, 10]
  assert not any(Hook(print).due(s, 10) for s in range(1, 11))
  with pytest.raises(ValueError, match="every=-1 must be an int >= 0"):
    Hook(print, every=-1)
  with pytest.raises(TypeError, match="fn=3 is not callable"):
    Hook(3, every=1)


def test_config_hooks_resolve_beside_the_config_file(tmp_path):
  (tmp_path / "hooks.py").write_text(textwrap.dedent(HOOKS))
  (tmp_path / "bad.py").write_text("def make(config):\n  return [print]\n")
  from configs import default

  config = default.get_config()
  config.hooks = resolve_hook_specs(("hooks.py:make",), tmp_path)
  assert config.hooks == (f"{tmp_path / 'hooks.py'}:make",)
  loaded = load_hooks(config, (Hook(print, every=7),))
  assert [getattr(h, "every", "wrapper") for h in loaded] == [7, 3, 4, "wrapper", 0]
  config.hooks = resolve_hook_specs(("bad.py:make",), tmp_path)
  with pytest.raises(TypeError, match="returned <built-in function print>, not a trainers.hooks"):
    load_hooks(config)
  with pytest.raises(TypeError, match="Wrapper mine: host_rows=3 is not callable"):
    Wrapper(host_rows=3, name="mine")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_user_hooks_run_on_schedule_on_every_process_without_extra_syncs(
  training_corpus, tmp_path_factory
):
  data = training_corpus
  folder = tmp_path_factory.mktemp("elsewhere")
  (folder / "hooks.py").write_text(textwrap.dedent(HOOKS))
  (folder / "config.py").write_text(textwrap.dedent(CONFIG))
  workdir = folder / "run"
  result = run_local(
    [
      sys.executable,
      "-m",
      "trainers.run.train_cli",
      f"--config={folder / 'config.py'}",
      f"--workdir={workdir}",
      f"--config.data.dir={data['dir']}",
      f"--config.data.source={data['source']}",
      "--config.train.steps=9",
      "--config.log_every=5",
      "--config.eval_every=0",
      "--config.checkpoint.every=0",
      "--config.sample_tokens=0",
      "--config.transfer_guard=disallow",
    ],
    num_processes=2,
    devices_per_process=2,
    timeout_s=240,
    grace_s=10,
    echo=False,
    cwd=str(ROOT),
    env={"PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": data["cache"]},
  )
  assert result.ok, result.report()
  for process in (0, 1):
    rows = [json.loads(line) for line in (workdir / f"hooks_p{process}.jsonl").open()]
    plain = [
      (r["step"], r["metrics"] is not None, r["fetched"]) for r in rows if r["hook"] == "plain"
    ]
    wants = [
      (r["step"], r["metrics"] is not None, r["fetched"]) for r in rows if r["hook"] != "plain"
    ]
    # Every 3 and at the end; metrics only where some due hook asked (9: the end).
    # Nothing was fetched before step 4: steps 1-3 made no host sync.
    assert plain == [(3, False, 0), (6, False, 5), (9, True, 9)], (process, plain)
    assert wants == [(4, True, 4), (8, True, 8), (9, True, 9)], (process, wants)
    assert rows[0]["params"], rows[0]
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in logged if "loss" in r]
  assert steps == list(range(1, 10)), steps  # the metrics hook wrote every row once
  assert [r["step"] for r in logged if "eval_loss" in r] == [9]  # one final eval
  # The wrapper saw process 0's rows of every step (4 of the 8 each; the
  # input thread may build a step ahead) and wrapped each of the 9 steps.
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["first_steps"] == list(range(9)), summary
  assert summary["step_calls"] == 9 and summary["rows_checked"] >= 9 * 4, summary
  assert "rows checked" in result.report() and "step calls" in result.report()
