"""The tiny Llama with two evals beside its loss eval: multiple choice and generation.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=examples/evals/config.py --workdir=workdir/evals
  spmd-train --mode=eval --workdir=workdir/evals      # the same evals on the saved step

`choices.jsonl` (lm-eval's "plain" rows: context, choices, answer) and
`prompts.jsonl` (prompts, some with an answer) sit beside this file and are
found from it. Every `eval_every` steps and at the end the run writes
`evals/code/acc`, `evals/code/acc_norm`, `evals/complete/exact_match`, ...
to metrics.jsonl and TensorBoard, and the completions to
`workdir/evals/evals/complete/step_<N>.jsonl` (docs/evals.md).
"""

import pathlib

import ml_collections

from configs import llama_tiny

HERE = pathlib.Path(__file__).resolve().parent


def get_config() -> ml_collections.ConfigDict:
  config = llama_tiny.get_config()
  config.evals.code = ml_collections.ConfigDict(
    dict(kind="multiple_choice", path=str(HERE / "choices.jsonl"), layout="plain", delimiter=" ")
  )
  config.evals.complete = ml_collections.ConfigDict(
    dict(kind="generation", path=str(HERE / "prompts.jsonl"), max_new_tokens=12, stop=["\n"])
  )
  return config
