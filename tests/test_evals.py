"""Evals' parts in one process: the layouts read, bad entries and rows named, lm-eval's pair
encoding on every tokenizer family, packed rows scored as each sequence alone, and each
choice's log-likelihood equal to transformers' on the HF fixtures.

The golden values come from `tests/fixtures/hf/make_fixtures.py` (torch and
transformers run there, never here); the whole path across processes is
`tests/test_evals_multiprocess.py`.
"""

from __future__ import annotations

import json
import re

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from spmd.errors import UserError
from tests import tokenizer_families
from trainers.config import resolve
from trainers.data.prepare import tokenizer as tok
from trainers.evals import encoding, items, multiple_choice, packing, specs
from trainers.evals.loglikelihood import model_logprobs
from trainers.hf import checkpoint, model_config
from trainers.models import llama
from trainers.models import transformer as lm

FIXTURES = "tests/fixtures/hf"


def _spec(path, **fields) -> specs.EvalSpec:
  return specs.eval_spec("mc", {"kind": "multiple_choice", "path": str(path), **fields})


def _write(tmp_path, rows, name="rows.jsonl"):
  path = tmp_path / name
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return path


def test_the_layouts_read_as_lm_eval_builds_their_prompts(tmp_path):
  hellaswag = {
    "activity_label": "Home and Garden",
    "ctx_a": "A man mows the lawn.",
    "ctx_b": "THE man",
    "endings": ["stops [header] to rest.", "waves."],
    "label": "1",
  }
  arc = {
    "question": "Which is a gas?",
    "choices": {"text": ["ice", "steam", "rock"], "label": ["1", "2", "3"]},
    "answerKey": "2",
  }
  mmlu = {"question": " 2 + 2 = ? ", "choices": ["3", "4"], "answer": 1}
  got = {
    layout: items.read_items(_spec(_write(tmp_path, [row]), layout=layout))[0]
    for layout, row in (("hellaswag", hellaswag), ("arc", arc), ("mmlu", mmlu))
  }
  assert got["hellaswag"] == items.ChoiceItem(
    "Home and Garden: A man mows the lawn. The man", ("stops to rest.", "waves."), 1
  )
  assert got["arc"] == items.ChoiceItem(
    "Question: Which is a gas?\nAnswer:", ("ice", "steam", "rock"), 1
  )
  assert got["mmlu"] == items.ChoiceItem("2 + 2 = ?\nA. 3\nB. 4\nAnswer:", ("A", "B"), 1)
  limited = _spec(_write(tmp_path, [mmlu] * 5 + [""]), layout="mmlu", limit=2)
  assert len(items.read_items(limited)) == 2


@pytest.mark.parametrize(
  "row, message",
  [
    ('{"context": "a", "choices": ["x", "y"]', "row 2 (plain layout): is not JSON"),
    ({"context": "a", "choices": ["x", "y"]}, "row 2 (plain layout): has no 'answer' field"),
    ({"context": "a", "choices": ["x", "y"], "answer": 2}, "answer=2 is out of range for its 2"),
    ({"context": "a", "choices": ["x"], "answer": 0}, "has 1 choice(s)"),
    ({"context": 3, "choices": ["x", "y"], "answer": 0}, "context=3 is a int, not a str"),
  ],
)
def test_a_bad_row_is_named_with_the_eval_file_and_row(tmp_path, row, message):
  good = {"context": "a", "choices": ["x", "y"], "answer": 0}
  path = _write(tmp_path, [good, row])
  if not message.startswith("row"):
    message = "row 2 (plain layout): " + message
  with pytest.raises(UserError, match=re.escape(f"config.evals.mc ({path}) {message}")):
    items.read_items(_spec(path))


def test_bad_entries_fail_when_the_config_is_resolved(tmp_path):
  from configs import llama_tiny

  path = _write(tmp_path, [{"context": "a", "choices": ["x", "y"], "answer": 5}])
  cases = {
    "kind='mc' must be one of": {"kind": "mc", "path": str(path)},
    "layout='race' must be one of": {
      "kind": "multiple_choice",
      "path": str(path),
      "layout": "race",
    },
    "config.evals.e.delimeter is not a key of a multiple_choice eval (did you mean 'delimiter'?)": {
      "kind": "multiple_choice",
      "path": str(path),
      "delimeter": "",
    },
    "max_new_tokens=0 must be an integer >= 1": {
      "kind": "generation",
      "path": str(path),
      "max_new_tokens": 0,
    },
    "path='nowhere.jsonl': no such file": {"kind": "generation", "path": "nowhere.jsonl"},
    "row 1 (plain layout): answer=5 is out of range": {
      "kind": "multiple_choice",
      "path": str(path),
    },
  }
  for message, entry in cases.items():
    config = llama_tiny.get_config()
    config.evals.e = ml_collections.ConfigDict(entry)
    with pytest.raises(ValueError, match=re.escape(message)):
      resolve(config)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tokenizers")
  return {
    name: tok.Tokenizer(tokenizer_families.tokenizer_file(name, folder))
    for name in tokenizer_families.FAMILIES
  }


@pytest.mark.parametrize("family", tokenizer_families.FAMILIES)
def test_pairs_are_encoded_as_lm_eval_encodes_them_on_every_family(families, family):
  found = families[family]
  encoder = encoding.TextEncoder(found.encode, found.decode, found.bos_id, found.eos_id)
  context = "Question: what is two plus two?\nAnswer:"
  pair = encoding.encode_pair(encoder, context, " four.", add_bos=True, window=512)
  # The context's own tokens, then the rest of the whole text's: here no token
  # spans the boundary, so the two are the whole text's tokens after a BOS.
  whole = [found.bos_id, *found.encode(context + " four.")]
  assert pair.tokens.tolist() == whole, tokenizer_families.token_names(found, pair.tokens)
  assert pair.scored == len(whole) - 1 - len(found.encode(context))
  # A context that ends in a space gives that space to the continuation.
  moved = encoding.encode_pair(encoder, context + " ", "four.", add_bos=True, window=512)
  assert moved.tokens.tolist() == pair.tokens.tolist() and moved.scored == pair.scored
  # A window too short for the pair drops context from the left, never the choice.
  short = encoding.encode_pair(encoder, context, " four.", add_bos=True, window=pair.scored + 1)
  assert short.truncated and short.tokens.tolist() == whole[-(pair.scored + 2) :]


def _tiny_models():
  shape = dict(vocab_size=64, seq_len=32, num_layers=2, d_model=32, num_heads=4, d_ff=64)
  return {
    "llama": llama.Llama(llama.LlamaConfig(**shape, num_kv_heads=2), rngs=nnx.Rngs(0)),
    "transformer": lm.TransformerLM(lm.TransformerConfig(**shape), rngs=nnx.Rngs(0)),
  }


@pytest.mark.parametrize("name", ["llama", "transformer"])
def test_packed_rows_score_each_sequence_as_it_scores_alone(name):
  model = _tiny_models()[name]
  rng = np.random.default_rng(0)
  sequences = [rng.integers(1, 64, rng.integers(2, 20)) for _ in range(12)]
  scored = [int(rng.integers(1, len(s))) for s in sequences]
  rows = packing.pack(sequences, scored, row_len=32, row_multiple=2)
  assert len(rows.inputs) < len(sequences)  # several a row
  packed = packing.sums_of(
    rows, np.concatenate([model_logprobs(model, b) for b in rows.batches(2)])
  )
  # Each alone: a row of its own from position 0, padded on the right (causal
  # attention: the padding after a token changes nothing before it).
  alone = np.zeros((len(sequences), 31), np.int32)
  for i, ids in enumerate(sequences):
    alone[i, : len(ids) - 1] = ids[:-1]
  logprobs = np.asarray(jax.nn.log_softmax(model(alone), axis=-1))
  for i, (ids, k) in enumerate(zip(sequences, scored)):
    expected = float(np.sum(logprobs[i, np.arange(len(ids) - 1), ids[1:]][-k:]))
    assert packed[i] == pytest.approx(expected, abs=1e-4), i


def _imported(folder: str) -> llama.Llama:
  fields = model_config.llama_fields(model_config.read_config(folder))
  config = llama.LlamaConfig(**{**fields, "attention": "xla"})
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: llama.Llama(config, rngs=nnx.Rngs(0))))
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), abstract)
  return nnx.merge(graphdef, checkpoint.read_params(folder, target))


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_each_choice_loglikelihood_equals_transformers(family):
  folder = f"{FIXTURES}/{family}"
  golden = json.loads(open(f"{folder}/golden_choices.json").read())
  spec = _spec(f"{FIXTURES}/choices.jsonl", delimiter=golden["delimiter"])
  found = tok.Tokenizer(f"{folder}/tokenizer.json")
  encoder = encoding.TextEncoder(found.encode, found.decode, found.bos_id, found.eos_id)
  questions = items.read_items(spec)
  pairs, _ = multiple_choice.encode_items(spec, questions, encoder, window=32)
  want = golden["pairs"]
  assert [p.tokens.tolist() for p in pairs] == [
    w["context_ids"] + w["continuation_ids"] for w in want
  ]
  model = _imported(folder)
  scores = multiple_choice.score_items(
    spec, questions, encoder, window=32, rows=2, score=lambda b: model_logprobs(model, b)
  )
  got = np.concatenate(scores.loglikelihoods)
  np.testing.assert_allclose(got, [w["loglikelihood"] for w in want], rtol=0, atol=1e-4)
  assert scores.metrics["rows"] == 2  # 12 pairs in two rows of 32, not twelve
