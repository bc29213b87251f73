"""Text from a trained run, decoded with a KV cache (the library of `spmd-sample`).

`sample_text` reads the run's resolved config (`W/config.json`) and one
checkpoint's parameters (the latest committed step, or `step`; `checkpoint`
for another location), on this one host: orbax's numpy restore reads them
whatever mesh and process count saved them, and they are placed on one CPU
device as `spmd-export` places them (`trainers.checkpoints.export.build_model`); no
optimizer state is read. The prompt is encoded through the run's tokenizer
(the copy the run keeps in `W`, e.g. `W/tokenizer.json`), or as UTF-8 bytes
for a byte-level run, and the tokens are decoded the same way. Decoding is
`trainers.models.decode.generate`: greedy by default, else drawn at
`temperature` from the `top_k` largest logits. The command
`spmd-sample --workdir=W --prompt=import` (trainers/sampling/sample_cli.py) prints it.

Example:
  >>> sample_text("W", "import", num_tokens=16)  # doctest: +SKIP
  Sample(text='import os...', step=300, prompt_tokens=2, new_tokens=16, ...)
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from trainers import paths
from trainers.checkpoints import export, saved_run
from trainers.data.prepare import tokenizer as tok
from trainers.data.prepare.token_codec import TokenCodec, token_codec, tokenizer_codec
from trainers.models import decode

DEFAULT_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class Sample:
  """What `sample_text` made."""

  text: str  # the prompt and what follows it, decoded
  step: int  # the checkpoint step
  prompt_tokens: int
  new_tokens: int
  describe: str  # how the tokens become text
  seconds: float  # decoding, compilation included


def run_codec(config: ml_collections.ConfigDict, workdir: str) -> TokenCodec:
  """The run's text <-> ids: its tokenizer file (the workdir's copy first), or bytes.

  Raises:
    FileNotFoundError: the run used a tokenizer and neither its copy in the
      workdir nor the original file is there.
  """
  spec = tok.tokenizer_spec(config)
  vocab = config.model.vocab_size
  if spec == tok.BYTES:
    return token_codec(vocab)
  suffix = ".json" if spec == tok.BPE else (paths.user_path(spec).suffix or ".json")
  candidates = [paths.user_path(workdir) / f"tokenizer{suffix}"]
  if spec != tok.BPE:
    candidates.append(paths.user_path(spec))
  for path in candidates:
    if path.exists():
      return tokenizer_codec(tok.Tokenizer(str(path)))
  raise FileNotFoundError(
    f"data.tokenizer={spec!r}: the run's tokenizer is not at {[str(p) for p in candidates]} "
    "(a run keeps a copy in its workdir when it starts)"
  )


def sample_text(
  workdir: str,
  prompt: str,
  num_tokens: int = DEFAULT_TOKENS,
  *,
  temperature: float = 0.0,
  top_k: int = 0,
  seed: int = 0,
  step: int | None = None,
  checkpoint: str = "",
) -> Sample:
  """Restores a run's checkpoint on one CPU device and continues `prompt` with a KV cache.

  `num_tokens` is cut to what the model's `seq_len` leaves after the prompt.

  Raises:
    ValueError: the prompt is empty, too long, or has ids outside the vocabulary.
    FileNotFoundError: no config, checkpoint, step or tokenizer (named).
  """
  if num_tokens < 1:
    raise ValueError(f"--num_tokens={num_tokens} must be >= 1")
  config = saved_run.saved_config(workdir)
  codec = run_codec(config, workdir)
  seq_len, vocab = config.model.seq_len, config.model.vocab_size
  ids = codec.encode(prompt)
  if not ids or len(ids) >= seq_len:
    raise ValueError(
      f"--prompt={prompt!r} is {len(ids)} tokens; the model reads 1 to {seq_len - 1} "
      f"before it has room for one more ({seq_len=})"
    )
  if max(ids) >= vocab:
    raise ValueError(f"--prompt={prompt!r} has token id {max(ids)}, outside {vocab=}")
  ref = saved_run.find_checkpoint(workdir, checkpoint, step)
  weights = saved_run.restore_weights(ref)  # numpy on this host: any saving mesh
  model = export.build_model(config, weights["params"], weights.get("model_state"))
  count = min(num_tokens, seq_len - len(ids))
  started = time.perf_counter()
  out = decode.generate(
    model,
    jnp.asarray([ids], jnp.int32),
    count,
    temperature=temperature,
    top_k=top_k,
    key=jax.random.key(seed),
  )
  out = np.asarray(jax.device_get(out))[0]
  return Sample(
    text=codec.decode(out),
    step=ref.step,
    prompt_tokens=len(ids),
    new_tokens=count,
    describe=codec.describe,
    seconds=time.perf_counter() - started,
  )
