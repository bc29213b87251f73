"""The evals of a run: checked and read before the data, encoded once, run on the run's mesh.

`EvalRunner.build(config, setup, task, batch_axes)` checks `config.evals`
against the run (the model scores text; each eval's batch divides over the
batch axes) and reads every file, before any data is prepared; `prepare`
encodes and packs the items once the run's tokenizer is known; calling it
runs every eval on a state and returns its metrics as
`evals/<name>/<metric>`. Every process calls it alike, with the same
arguments: every process reads the whole file and packs the same rows,
each device scores its own rows (the batch axes split them), and every
process gets every row's result back (`loglikelihood.mesh_scorer`), so each
item is scored exactly once and every process holds the same metrics.
Process 0 writes a generation eval's completions to
`W/evals/<name>/step_<N>.jsonl`.

Example (`W` a run whose config has `config.evals`):
  >>> runner = EvalRunner.build(config, setup, task, batch_axes)  # doctest: +SKIP
  >>> runner.prepare(encoding.run_encoder(config, "W"))  # doctest: +SKIP
  >>> runner(state, step=200, workdir="W")  # doctest: +SKIP
  {'evals/arc/acc': 0.31, 'evals/arc/acc_norm': 0.35, ..., 'evals/qa/exact_match': 0.1, ...}
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import ml_collections

from spmd.errors import UserError
from trainers import paths
from trainers.evals import encoding, generation, loglikelihood, multiple_choice
from trainers.evals.items import read_items
from trainers.evals.specs import GENERATION, MULTIPLE_CHOICE, EvalSpec, eval_specs
from trainers.models import decode_batch, llama
from trainers.models import transformer as lm
from trainers.step.eval_step import eval_inputs
from trainers.step.precision import Precision
from trainers.step.state import StateSetup, build_model
from trainers.tasks import Task

log = logging.getLogger(__name__)
PREFIX = "evals"


def metric_name(eval_name: str, metric: str) -> str:
  """How an eval's metric is written: `evals/<name>/<metric>`.

  >>> metric_name("arc", "acc_norm")
  'evals/arc/acc_norm'
  """
  return f"{PREFIX}/{eval_name}/{metric}"


@dataclasses.dataclass
class _Eval:
  spec: EvalSpec
  items: list
  rows: int  # per forward pass (multiple choice) or decode batch (generation)
  prepared: Any = None  # PackedChoices, or the prompts' ids


class EvalRunner:
  """The run's evals; see the module docstring."""

  def __init__(self, evals: list[_Eval], setup: StateSetup, task: Task, batch_axes, window: int):
    self._evals, self._setup, self._task = evals, setup, task
    self._batch_axes, self.window = tuple(batch_axes), window
    self._encoder: encoding.TextEncoder | None = None
    self._scorers: dict[int, Any] = {}
    # One jitted cast for the run: a new jax.jit each eval would trace it again.
    self._cast_params = jax.jit(Precision(setup.precision).cast_params)

  @property
  def names(self) -> list[str]:
    return [e.spec.name for e in self._evals]

  @classmethod
  def build(
    cls,
    config: ml_collections.ConfigDict,
    setup: StateSetup,
    task: Task,
    batch_axes: tuple[str, ...],
  ) -> EvalRunner | None:
    """The runner of `config.evals` (None when it names none), its files read and checked.

    Raises:
      UserError: an entry, a file or a row is bad, the model cannot be
        scored or decoded, or an eval's batch does not divide over the batch axes.
    """
    specs = eval_specs(config.get("evals"))
    if not specs:
      return None
    model = build_model(setup, setup.abstract["params"], setup.abstract.get("model_state"))
    where = f"config.evals ({', '.join(s.name for s in specs)})"
    try:
      loglikelihood.check_model(model, where)
    except TypeError as e:
      raise UserError(str(e)) from None
    mesh = setup.mesh
    shards = math.prod(mesh.shape[a] for a in batch_axes) if mesh is not None else 1
    evals = []
    for spec in specs:
      if spec.kind == GENERATION and not isinstance(model, llama.Llama | lm.TransformerLM):
        raise UserError(
          f"{spec.where}: generation decodes Llama or TransformerLM models with a KV cache, "
          f"not {type(model).__name__}"
        )
      rows = spec.batch or config.global_batch
      if rows % shards:
        raise UserError(
          f"config.evals.{spec.name}.batch: {rows} rows do not divide over the mesh's batch "
          f"axes {batch_axes} ({shards} devices); give a multiple of {shards}"
        )
      evals.append(_Eval(spec, read_items(spec), rows))
    return cls(evals, setup, task, batch_axes, model.config.seq_len)

  def prepare(self, encoder: encoding.TextEncoder) -> None:
    """Encodes (and packs) every eval's items with the run's text encoder, once.

    Raises:
      UserError: an item that cannot be encoded (named with its eval and number).
    """
    self._encoder = encoder
    for e in self._evals:
      if e.spec.kind == MULTIPLE_CHOICE:
        e.prepared = multiple_choice.pack_items(e.spec, e.items, encoder, self.window, e.rows)
      else:
        e.prepared = generation.encode_prompts(e.spec, e.items, encoder, self.window)

  def _scorer(self, rows: int):
    if rows not in self._scorers:
      self._scorers[rows] = loglikelihood.mesh_scorer(
        self._setup, self._task, self._batch_axes, rows
      )
    return self._scorers[rows]

  def _decoder(self, inputs: dict):
    """`decode(prompts, count)` with the state's model in the compute dtype, on the run's mesh."""
    setup = self._setup
    params = self._cast_params(inputs["params"])  # read once an eval, in that dtype
    model = build_model(setup, params, inputs.get("model_state"))
    model.eval()
    eos = self._encoder.eos_id

    def decode(prompts: list[list[int]], count: int):
      out = decode_batch.generate_batch(
        model, prompts, count, eos_id=eos, rules=setup.rules, mesh=setup.mesh
      )
      return out.tokens, out.lengths

    return decode

  def __call__(self, state: dict, step: int, workdir: str | None = None) -> dict[str, float]:
    """Every eval on `state` (the train state, or its params and model state); its metrics.

    Every process calls it; process 0 writes generation evals' completions under `workdir`.
    """
    if self._encoder is None:
      raise RuntimeError("EvalRunner.prepare(encoder) must run before the evals")
    inputs = eval_inputs(state)
    out: dict[str, float] = {}
    decode = None
    for e in self._evals:
      if e.spec.kind == MULTIPLE_CHOICE:
        scorer = functools.partial(self._scorer(e.rows), inputs)
        found = multiple_choice.score_packed(e.prepared, e.rows, scorer)
        metrics = found.metrics
      else:
        decode = decode or self._decoder(inputs)
        made = generation.complete_prompts(
          e.spec, e.items, e.prepared, self._encoder, e.rows, decode
        )
        metrics = made.metrics
        if workdir is not None and jax.process_index() == 0:
          path = generation.completions_file(paths.user_path(workdir), e.spec.name, step)
          generation.write_completions(path, made.rows)
      out.update({metric_name(e.spec.name, k): float(v) for k, v in metrics.items()})
    return out
