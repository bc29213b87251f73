"""`spmd-sample`: text from a trained run, decoded in batches with a KV cache on the devices.

  spmd-sample --workdir=W --prompt=import
  spmd-sample --workdir=W --prompts=prompts.jsonl --out=completions.jsonl --num_tokens=256
  spmd-sample --workdir=W --prompt="def f(" --temperature=0.8 --top_k=20 --top_p=0.9 --seed=1
  spmd-sample --workdir=W --prompts=p.jsonl --stop="\\n\\n" --stop="###"  # stop strings
  spmd-sample --workdir=W --prompt=import --step=200 --cpu  # a step, on one CPU device

A `--prompts` file has one JSON object a line: `{"prompt": "...", "seed": 3}`
(`seed` optional: default `--seed` + the row's index). Its completions are
JSONL, one a prompt in order: `{"prompt", "completion", "tokens", "stopped",
"seed"}` (`stopped`: "eos", "stop" or "length"), on stdout or `--out`. A
`--prompt` prints the prompt and its completion as text. What made them (step,
tokens, where, compile, prefill and decode seconds, decode tokens/s) goes to
stderr. Under a launcher (`spmd-launch local --num-processes 2 -- spmd-sample
...`) every process decodes its share of the batch on the run's mesh and
process 0 writes. Parses the flags and calls
`trainers.sampling.sample.sample_prompts`, which says how the checkpoint is
read and the prompts encoded.
"""

from __future__ import annotations

import json
import sys

from spmd import errors, startup_gc
from spmd.errors import UserError


def main(argv: list[str] | None = None) -> int:
  """`spmd-sample`: see the module docstring. 0, or 2 on a user error (`spmd.errors`)."""
  startup_gc.pause_collection()  # until `_main` has imported the sampler
  return errors.run("spmd-sample", lambda: _main(sys.argv[1:] if argv is None else argv))


def read_prompts(path: str, first_seed: int) -> tuple[list[str], list[int]]:
  """The prompts and seeds of a JSONL file of `{"prompt": str, "seed": int (optional)}` rows.

  Raises:
    UserError: the file is missing, or a row is no such object (names the file and line).
  """
  from trainers import paths

  file = paths.user_path(path)
  if not file.exists():
    raise UserError(f"--prompts={path}: no such file")
  prompts, seeds = [], []
  for number, line in enumerate(file.read_text().splitlines(), start=1):
    if not line.strip():
      continue
    where = f"--prompts={path} line {number}"
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
      raise UserError(f'{where}: a row is {{"prompt": "text"}} (seed optional), got {line[:80]}')
    seed = row.get("seed", first_seed + len(prompts))
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
      raise UserError(f"{where}: seed={seed!r} must be an integer in 0..2**32-1")
    prompts.append(row["prompt"])
    seeds.append(seed)
  if not prompts:
    raise UserError(f"--prompts={path} has no rows")
  return prompts, seeds


def _main(argv: list[str]) -> None:
  parser = errors.ArgumentParser(prog="spmd-sample", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="the run's workdir")
  parser.add_argument("--prompt", help="the text to continue")
  parser.add_argument("--prompts", help='a JSONL file of {"prompt": ..., "seed": ...} rows')
  parser.add_argument("--out", default="", help="where the JSONL completions go (default stdout)")
  parser.add_argument("--num_tokens", type=int, default=64, help="new tokens a row makes at most")
  parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  parser.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest (0: all)")
  parser.add_argument("--top_p", type=float, default=1.0, help="the nucleus' probability (1: all)")
  parser.add_argument("--seed", type=int, default=0, help="the first row's seed; row i: seed + i")
  parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
  parser.add_argument("--no_eos", action="store_true", help="do not stop at the tokenizer's EOS")
  parser.add_argument("--step", type=int, default=None, help="default: the latest committed")
  parser.add_argument("--checkpoint", default="", help="a workdir, checkpoint or step directory")
  parser.add_argument("--cpu", action="store_true", help="decode on one CPU device")
  args = parser.parse_args(argv)
  if (args.prompt is None) == (args.prompts is None):
    raise UserError("give one of --prompt=TEXT or --prompts=FILE.jsonl")
  if args.prompts is not None:
    prompts, seeds = read_prompts(args.prompts, args.seed)
  else:
    prompts, seeds = [args.prompt], [args.seed]
  import jax
  from absl import logging

  import spmd
  from trainers.checkpoints import saved_run

  logging.set_verbosity(logging.ERROR)  # orbax's notes on a read-only checkpoint are expected
  if args.cpu:
    jax.config.update("jax_platforms", "cpu")
  with errors.user_input(ValueError, FileNotFoundError):
    # A workdir that is no run answers before any backend or slice is asked about.
    saved_run.saved_config(args.workdir)
  spmd.initialize()  # one process of several under a launcher; else nothing
  from trainers.sampling.sample import sample_prompts

  startup_gc.freeze_and_resume()

  with errors.user_input(ValueError, FileNotFoundError):  # the run, step or prompts given
    found = sample_prompts(
      args.workdir,
      prompts,
      args.num_tokens,
      temperature=args.temperature,
      top_k=args.top_k,
      top_p=args.top_p,
      seeds=seeds,
      stop=args.stop,
      use_eos=not args.no_eos,
      step=args.step,
      checkpoint=args.checkpoint,
      on_cpu=args.cpu,
    )
  if jax.process_index() != 0:
    return
  how = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
  if args.temperature and args.top_k:
    how += f", top {args.top_k}"
  if args.temperature and args.top_p < 1:
    how += f", top_p {args.top_p:g}"
  made = sum(r.tokens for r in found.rows)
  print(
    f"spmd-sample: step {found.step}, {len(prompts)} prompt(s) of {min(found.prompt_tokens)}"
    f"..{max(found.prompt_tokens)} tokens + {made} new tokens ({how}; {found.describe}) on "
    f"{found.platform}: compile {found.compile_seconds:.2f} s, prefill "
    f"{found.prefill_seconds:.3f} s, decode {found.decode_seconds:.3f} s, "
    f"{found.decode_tokens_per_second:.1f} tokens/s",
    file=sys.stderr,
    flush=True,
  )
  if args.prompts is None:
    print(found.rows[0].prompt + found.rows[0].completion, flush=True)
    return
  lines = "".join(json.dumps(r.__dict__, ensure_ascii=False) + "\n" for r in found.rows)
  if args.out:
    from trainers import paths

    paths.user_path(args.out).write_text(lines)
  else:
    sys.stdout.write(lines)
    sys.stdout.flush()


if __name__ == "__main__":
  sys.exit(main())
