"""`spmd-sample`: text from a trained run, decoded with a KV cache.

  spmd-sample --workdir=W --prompt=import
  spmd-sample --workdir=W --prompt="def f(" --num_tokens=40 --temperature=0.8 --top_k=20 --seed=1
  spmd-sample --workdir=W --prompt=import --step=200      # a named checkpoint step

Parses the flags and calls `trainers.sampling.sample.sample_text`, which says how the
checkpoint is read and the prompt encoded; prints the text on stdout and what
made it (step, tokens, decoding, seconds) on stderr.
"""

from __future__ import annotations

import sys

import jax

from spmd import errors
from trainers.sampling.sample import DEFAULT_TOKENS, sample_text


def main(argv: list[str] | None = None) -> int:
  """`spmd-sample`: see the module docstring. 0, or 2 on a user error (`spmd.errors`)."""
  return errors.run("spmd-sample", lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> None:
  parser = errors.ArgumentParser(prog="spmd-sample", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="the run's workdir")
  parser.add_argument("--prompt", required=True, help="the text to continue")
  parser.add_argument("--num_tokens", type=int, default=DEFAULT_TOKENS, help="tokens to add")
  parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  parser.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest (0: all)")
  parser.add_argument("--seed", type=int, default=0, help="the draws' jax.random key")
  parser.add_argument("--step", type=int, default=None, help="default: the latest committed")
  parser.add_argument("--checkpoint", default="", help="a workdir, checkpoint or step directory")
  args = parser.parse_args(argv)
  from absl import logging

  logging.set_verbosity(logging.ERROR)  # orbax's notes on a read-only checkpoint are expected
  jax.config.update("jax_platforms", "cpu")  # one CPU device, as spmd-export's models
  with errors.user_input(ValueError, FileNotFoundError):  # the run, step or prompt given
    found = sample_text(
      args.workdir,
      args.prompt,
      args.num_tokens,
      temperature=args.temperature,
      top_k=args.top_k,
      seed=args.seed,
      step=args.step,
      checkpoint=args.checkpoint,
    )
  how = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
  if args.temperature and args.top_k:
    how += f", top {args.top_k}"
  print(
    f"spmd-sample: step {found.step}, {found.prompt_tokens} prompt + {found.new_tokens} new "
    f"tokens ({how}; {found.describe}), {found.seconds:.2f} s",
    file=sys.stderr,
    flush=True,
  )
  print(found.text, flush=True)


if __name__ == "__main__":
  sys.exit(main())
