"""Batched decoding of ragged prompts (`trainers.models.decode_batch`): each row decodes as its
prompt alone, with and without a cache; a row's draws do not depend on its batch mates;
a row stops at EOS and says where; the nucleus keeps what it should."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainers.models import decode, decode_batch, llama
from trainers.models import transformer as lm

SEQ_LEN, NEW = 24, 5
# One of length 1, one that leaves exactly NEW slots of the model's seq_len, one between:
# three lengths, so every row is left-padded by another amount (the longest by none).
# Each length is a program of its own for the rows decoded alone: no more rows than that.
PROMPTS = [[7], list(range(3, 3 + SEQ_LEN - NEW)), [60, 2]]


def _llama():
  config = llama.LlamaConfig(
    vocab_size=96, seq_len=SEQ_LEN, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
    d_ff=64,
  )  # fmt: skip
  return llama.Llama(config, rngs=nnx.Rngs(1))


def _transformer():
  config = lm.TransformerConfig(
    vocab_size=96, seq_len=SEQ_LEN, num_layers=2, d_model=32, num_heads=4, d_ff=64
  )
  return lm.TransformerLM(config, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def llama_greedy():
  """The Llama and its greedy batch of PROMPTS, made once: the ragged and the EOS test read it."""
  model = _llama()
  return model, decode_batch.generate_batch(model, PROMPTS, NEW)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "transformer"])
def test_each_ragged_rows_greedy_tokens_are_its_prompt_decoded_alone_and_uncached(
  name, llama_greedy
):
  if name == "llama":
    model, out = llama_greedy
  else:
    model = _transformer()
    out = decode_batch.generate_batch(model, PROMPTS, NEW)
  assert out.tokens.shape == (len(PROMPTS), NEW) and out.lengths.tolist() == [NEW] * len(PROMPTS)
  assert out.steps == NEW - 1 and out.platform == "cpu"
  for row, ids in enumerate(PROMPTS):
    prompt = jnp.array([ids], jnp.int32)
    alone = np.asarray(decode.generate(model, prompt, NEW))[0, len(ids) :]
    uncached = np.asarray(decode.generate_uncached(model, prompt, NEW))[0, len(ids) :]
    np.testing.assert_array_equal(out.tokens[row], alone, err_msg=f"row {row}")
    np.testing.assert_array_equal(out.tokens[row], uncached, err_msg=f"row {row}")


@pytest.mark.slow
def test_a_rows_draws_depend_on_its_seed_not_on_its_batch_mates(llama_greedy):
  model, _ = llama_greedy
  drawn = dict(temperature=1.5, top_k=40, top_p=0.95)
  many = decode_batch.generate_batch(model, PROMPTS, NEW, seeds=[3, 4, 5], **drawn)
  # Row 2 alone, in a batch of another size and padding, keeps its seed's tokens.
  alone = decode_batch.generate_batch(model, [PROMPTS[2]], NEW, seeds=[5], **drawn)
  np.testing.assert_array_equal(many.tokens[2], alone.tokens[0])
  pair = decode_batch.generate_batch(model, [PROMPTS[0], PROMPTS[2]], NEW, seeds=[9, 5], **drawn)
  np.testing.assert_array_equal(many.tokens[2], pair.tokens[1])
  other = decode_batch.generate_batch(model, [PROMPTS[2]], NEW, seeds=[6], **drawn)
  assert not np.array_equal(other.tokens[0], alone.tokens[0])  # the seed does draw


@pytest.mark.slow
def test_a_row_stops_after_its_eos_pads_and_reports_its_length(llama_greedy):
  model, greedy = llama_greedy[0], llama_greedy[1].tokens
  eos = int(greedy[1, 2])  # a token row 1 makes third
  out = decode_batch.generate_batch(model, PROMPTS, NEW, eos_id=eos, pad_id=95)
  for row in range(len(PROMPTS)):
    hits = np.flatnonzero(greedy[row] == eos)
    length = int(hits[0]) + 1 if hits.size else NEW
    assert out.lengths[row] == length, (row, greedy[row], eos)
    np.testing.assert_array_equal(out.tokens[row, :length], greedy[row, :length])
    assert (out.tokens[row, length:] == 95).all()
  # Every row stopped: the loop ends there rather than running NEW steps.
  stopped = decode_batch.generate_batch(model, [PROMPTS[1]], NEW, eos_id=eos)
  assert stopped.lengths.tolist() == [3] and stopped.steps == 2


def test_the_nucleus_keeps_the_largest_until_top_p_and_always_the_first():
  logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3], [0.97, 0.01, 0.01, 0.01]]))
  kept = np.isfinite(np.asarray(decode_batch.filter_logits(logits, 0, 0.75)))
  assert kept.tolist() == [[False, True, False, True], [True, False, False, False]]
  both = np.isfinite(np.asarray(decode_batch.filter_logits(logits, 1, 0.99)))
  assert both.sum(axis=1).tolist() == [1, 1]


def test_bad_arguments_are_named():
  model = _llama()
  cases = [
    ([[1, 2]], dict(num_tokens=SEQ_LEN), "num_tokens=24"),
    ([[1], []], dict(num_tokens=2), "prompt 1 is empty"),
    ([[1, 96]], dict(num_tokens=2), "token id 96"),
    ([[1]], dict(num_tokens=2, top_p=0.0), "top_p=0.0"),
    ([[1]], dict(num_tokens=2, seeds=[1, 2]), "2 seeds for 1 prompts"),
    ([[1]], dict(num_tokens=2, eos_id=200), "eos_id=200"),
  ]
  for prompts, kwargs, match in cases:
    with pytest.raises(ValueError, match=match):
      decode_batch.generate_batch(model, prompts, **kwargs)


def test_the_prefill_holds_the_last_positions_logits_not_every_prompt_positions():
  """A batch of long prompts over a large vocabulary: batch x prompt x vocab floats would be the
  prefill's largest buffer (gigabytes for 32 x 2048 x 32000); only the last slot's are needed."""
  config = llama.LlamaConfig(
    vocab_size=8192, seq_len=128, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64
  )
  graphdef, state = nnx.split(llama.Llama(config, rngs=nnx.Rngs(0)))
  batch, prompt = 8, 64
  compiled = decode_batch._prefill.lower(
    graphdef, state, jnp.zeros((batch, prompt), jnp.int32), jnp.zeros((batch,), jnp.int32),
    jnp.zeros((batch,), jnp.uint32), prompt + 8, 0.0, 0, 1.0, (), None,
  ).compile()  # fmt: skip
  every_logit = batch * prompt * config.vocab_size * 4
  assert compiled.memory_analysis().temp_size_in_bytes < every_logit / 4
