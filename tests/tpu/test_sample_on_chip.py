"""`spmd-sample` on the chip: 32 ragged prompts from a JSONL file decode on the TPU, each row as
its prompt alone, with the cache and without.

In the test process (one program at a time can hold the chip), through the CLI's `main`.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import llama_tiny
from trainers.checkpoints import saved_run
from trainers.models import decode
from trainers.run.train import train_and_evaluate
from trainers.sampling import restore, sample, sample_cli

NEW = 16


def test_spmd_sample_of_32_ragged_prompts_decodes_on_the_chip_each_as_alone(tmp_path, capsys):
  """Trains its own llama_tiny for 20 steps on the chip: the CPU suite's shared runs are CPU's."""
  config = llama_tiny.get_config()
  config.data.dir = str(tmp_path / "data")
  config.train.steps, config.train.warmup_steps = 20, 5
  config.eval_every, config.sample_tokens, config.checkpoint.every = 0, 0, 20
  # Sameness of greedy tokens across programs of other shapes (a batch of 32
  # left-padded rows, one row, no cache) holds where the logits are computed
  # alike; in bf16, or float32 at the chip's one-pass default, a near tie
  # between two tokens can fall either way. So float32 at full precision.
  config.train.precision = "float32"
  workdir = tmp_path / "run"
  train_and_evaluate(config, str(workdir))
  saved = saved_run.saved_config(workdir)
  codec = sample.run_codec(saved, str(workdir))
  words = "the model of a function returns its value and".split()
  texts = [" ".join(words[: i % len(words)]) for i in range(31)]  # "" is BOS alone: 1 token
  longest = " ".join(words * 20)
  while len(codec.encode(longest)) > saved.model.seq_len - NEW:
    longest = longest[:-3]
  texts.append(longest)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
  out = tmp_path / "out.jsonl"
  argv = [f"--workdir={workdir}", f"--prompts={prompts}", f"--out={out}", f"--num_tokens={NEW}"]
  with jax.default_matmul_precision("highest"):
    assert sample_cli.main([*argv, "--no_eos"]) == 0
  err = capsys.readouterr().err
  assert " on tpu: " in err and "tokens/s" in err, err
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["prompt"] for r in rows] == texts and {r["tokens"] for r in rows} == {NEW}

  restored = restore.restore_model(saved, saved_run.find_checkpoint(str(workdir), "", None))
  assert restored.platform == "tpu"
  params = jax.tree.leaves(nnx.state(restored.model, nnx.Param))
  assert {d.platform for p in params for d in p.devices()} == {"tpu"}
  for row, text in zip(rows, texts, strict=True):
    ids = jnp.array([codec.encode(text)], jnp.int32)
    with jax.default_matmul_precision("highest"):
      cached = np.asarray(decode.generate(restored.model, ids, NEW))[0, ids.shape[1] :]
      uncached = np.asarray(decode.generate_uncached(restored.model, ids, NEW))[0, ids.shape[1] :]
    alone, without_cache = codec.decode(cached.tolist()), codec.decode(uncached.tolist())
    assert (row["completion"], alone) == (without_cache, without_cache), (text, row, alone)
