"""Text from a trained run, decoded in batches with a KV cache (the library of `spmd-sample`).

`sample_prompts` reads the run's resolved config (`W/config.json`), restores
one checkpoint's parameters (the latest committed step, or `step`;
`checkpoint` for another location) onto the run's mesh on this machine's
devices, in the compute dtype (`trainers.sampling.restore`), encodes the
prompts through the run's tokenizer (its copy in `W`, e.g.
`W/tokenizer.json`), or as UTF-8 bytes for a byte-level run, and continues
them all in one batch (`trainers.models.decode_batch.generate_batch`: ragged
prompts, greedy or drawn, a seed a row, a stop at the tokenizer's EOS).
Stop strings are found on the host after the program: a row's completion
ends with the first stop string its text reaches, and counts the tokens it
took to reach it. The command `spmd-sample` (trainers/sampling/sample_cli.py)
reads the prompts from a JSONL file or a flag.

Example:
  >>> found = sample_prompts("W", ["import", "def f("], num_tokens=16)  # doctest: +SKIP
  >>> found.rows[0].completion, found.decode_tokens_per_second  # doctest: +SKIP
  (' os\\n...', 812.5)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from trainers.checkpoints import saved_run
from trainers.data.prepare.token_codec import cut_at_stop, run_codec, run_tokenizer
from trainers.models import decode_batch
from trainers.sampling.restore import restore_model

DEFAULT_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class Row:
  """One prompt's completion."""

  prompt: str
  completion: str  # the new tokens' text, to its stop
  tokens: int  # new tokens, to its stop (an EOS included)
  stopped: str  # "eos", "stop" (a stop string), or "length"
  seed: int


@dataclasses.dataclass(frozen=True)
class Samples:
  """What `sample_prompts` made, and how fast."""

  rows: list[Row]
  step: int  # the checkpoint step
  prompt_tokens: list[int]
  describe: str  # how the tokens become text
  platform: str  # where the decode ran
  compile_seconds: float
  prefill_seconds: float
  decode_seconds: float
  decode_tokens_per_second: float  # the decode loop's tokens (every row's, to its stop) a second


def sample_prompts(
  workdir: str,
  prompts: Sequence[str],
  num_tokens: int = DEFAULT_TOKENS,
  *,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seeds: Sequence[int] | None = None,
  stop: Sequence[str] = (),
  use_eos: bool = True,
  step: int | None = None,
  checkpoint: str = "",
  on_cpu: bool = False,
) -> Samples:
  """Restores a run's checkpoint onto this machine's devices and continues every prompt.

  `num_tokens` is cut to what the model's `seq_len` leaves after the longest
  prompt. Every process of a multi-process job calls it with the same
  arguments and gets the same rows.

  Raises:
    ValueError: a prompt is empty, too long, or has ids outside the vocabulary (named by row).
    FileNotFoundError: no config, checkpoint, step or tokenizer (named).
  """
  if num_tokens < 1:
    raise ValueError(f"--num_tokens={num_tokens} must be >= 1")
  if not prompts:
    raise ValueError("no prompts: give --prompt or a --prompts file with rows")
  seeds = list(range(len(prompts))) if seeds is None else list(seeds)
  config = saved_run.saved_config(workdir)
  tokenizer = run_tokenizer(config, workdir)
  codec = run_codec(config, workdir)
  seq_len, vocab = config.model.seq_len, config.model.vocab_size
  ids = [codec.encode(p) for p in prompts]
  for row, (text, these) in enumerate(zip(prompts, ids, strict=True)):
    if not these or len(these) >= seq_len:
      raise ValueError(
        f"prompt {row} ({text[:40]!r}) is {len(these)} tokens; the model reads 1 to "
        f"{seq_len - 1} before it has room for one more ({seq_len=})"
      )
    if max(these) >= vocab:
      raise ValueError(f"prompt {row} ({text[:40]!r}) has token id {max(these)}, outside {vocab=}")
  ref = saved_run.find_checkpoint(workdir, checkpoint, step)
  restored = restore_model(config, ref, on_cpu)
  count = min(num_tokens, seq_len - max(len(i) for i in ids))
  eos = tokenizer.eos_id if use_eos and tokenizer is not None else None
  # Rows beyond the prompts, to a multiple of the batch axes, repeat the first; dropped after.
  extra = -len(ids) % restored.batch_multiple
  out = decode_batch.generate_batch(
    restored.model,
    ids + [ids[0]] * extra,
    count,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    seeds=seeds + [seeds[0]] * extra,
    eos_id=eos,
    rules=restored.rules,
    mesh=restored.mesh,
  )
  rows = []
  for row, text in enumerate(prompts):
    length = int(out.lengths[row])
    new = [int(t) for t in out.tokens[row, :length]]
    stopped = "eos" if eos is not None and new and new[-1] == eos else "length"
    shown = new[:-1] if stopped == "eos" else new
    completion, cut = codec.decode(shown), cut_at_stop(codec, shown, stop)
    if cut is not None:
      (completion, length), stopped = cut, "stop"
    rows.append(Row(text, completion, length, stopped, seeds[row]))
  kept = out.lengths[: len(prompts)]
  made = int(np.maximum(kept - 1, 0).sum())  # the decode loop's tokens; the first are the prefill's
  return Samples(
    rows=rows,
    step=ref.step,
    prompt_tokens=[len(i) for i in ids],
    describe=codec.describe,
    platform=out.platform,
    compile_seconds=out.compile_seconds,
    prefill_seconds=out.prefill_seconds,
    decode_seconds=out.decode_seconds,
    decode_tokens_per_second=made / out.decode_seconds if out.decode_seconds > 0 else 0.0,
  )
