"""Evals inside a run and alone: multiple choice by log-likelihood, and generation.

`config.evals` names eval tasks (`specs.py` says their keys); each runs
every `eval_every` steps on the training mesh, beside the loss eval, and in
`spmd-train --mode=eval`. Its scores are written as `evals/<name>/<metric>`
to the run's metrics (metrics.jsonl, TensorBoard, W&B).

  specs.py            config.evals: the entries, their defaults and checks
  items.py            the JSONL files and the layouts read (HellaSwag, ARC, MMLU, ...)
  encoding.py         (context, continuation) to token ids as lm-eval does
  packing.py          many scored sequences to rows of segments
  loglikelihood.py    each token's log-probability on the mesh, chunked over the sequence
  multiple_choice.py  acc and acc_norm of a multiple-choice eval
  generation.py       greedy completions, their file, and exact match
  runner.py           the evals of a run, built once, called by the run and by --mode=eval
"""
