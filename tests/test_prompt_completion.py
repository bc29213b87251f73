"""Prompt/completion data (`config.data.format="prompt_completion"`, issue 45 item 4): each JSONL
row packed as BOS + prompt + completion + EOS with a loss mask on the completion and EOS, checked
token by token against a reference built here; a packed row's loss is the sum of its examples'
losses alone; bad rows are named by file and line. In-process, on a BPE trained on the rows."""

import json

import numpy as np
import pytest
from flax import nnx

from trainers.data.prepare import packed, source_packed
from trainers.data.prepare import tokenizer as tok
from trainers.data.prepare.holdout import TRAIN
from trainers.data.prepare.source_files import SourceError, SourceSpec, list_source
from trainers.data.records.datasets import open_source
from trainers.models.transformer import TransformerConfig, TransformerLM
from trainers.tasks import lm

SEQ_LEN, RUN_WINDOWS = 16, 2
# Prompts that end in a space: tokenized with their completion, the space
# and the completion's first word merge into one BPE token, so a packer
# that tokenized the joined text would put the boundary inside a token.
ROWS = [
  {"prompt": "Question: two plus two? Answer: ", "completion": "four"},
  {"prompt": "Question: the sky? Answer: ", "completion": "blue, on a clear day"},
  {"prompt": "Say hi. ", "completion": "hi"},
  {"prompt": "", "completion": "no prompt at all"},
  {"prompt": "An empty completion: ", "completion": ""},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> tok.Tokenizer:
  texts = [r["prompt"] + r["completion"] for r in ROWS] * 20
  return tok.bpe_tokenizer(
    tmp_path_factory.mktemp("bpe"), "rows", vocab_size=400, texts=lambda: texts
  )


def _write(path, rows) -> str:
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def _prepare(tmp_path, spec: str, tokenizer, seq_len=SEQ_LEN, skip_bad_rows=0):
  config = source_packed.source_config(
    list_source(SourceSpec(spec)),
    split=TRAIN,
    validation_percent=0.0,
    seq_len=seq_len,
    vocab_size=400,
    tokenizer=tokenizer,
    run_windows=RUN_WINDOWS,
    skip_bad_rows=skip_bad_rows,
    format="prompt_completion",
  )
  return source_packed.prepare_source(tmp_path / "data", config)


def _reference(tokenizer) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Each row's ids and loss mask, built by hand: BOS, prompt (0s), completion and EOS (1s)."""
  ids, masks = [], []
  for row in ROWS:
    prompt, completion = tokenizer.encode(row["prompt"]), tokenizer.encode(row["completion"])
    ids.append(np.array([tokenizer.bos_id, *prompt, *completion, tokenizer.eos_id]))
    masks.append(np.array([0] * (1 + len(prompt)) + [1] * (len(completion) + 1)))
  return ids, masks


def test_each_token_is_masked_as_the_reference_and_the_boundary_is_exact(tmp_path, tokenizer):
  apart = [tokenizer.encode(r["prompt"]) + tokenizer.encode(r["completion"]) for r in ROWS]
  together = [tokenizer.encode(r["prompt"] + r["completion"]) for r in ROWS]
  assert apart != together  # so the test tells a packer that tokenized them joined
  prepared = _prepare(tmp_path, _write(tmp_path / "a.jsonl", ROWS), tokenizer)
  assert prepared.documents == len(ROWS)
  records = open_source(prepared.name, TRAIN, str(tmp_path / "data"), None)
  records = [records[i] for i in range(len(records))]
  ids, masks = _reference(tokenizer)
  stream, stream_mask = np.concatenate(ids), np.concatenate(masks)
  # The completion's tokens decode to the completion: the mask covers it and nothing else.
  for row, example, mask in zip(ROWS, ids, masks):
    assert tokenizer.decode(example[(mask == 1)][:-1]) == row["completion"]
  # The records' runs and loss masks are the reference stream's, token by token.
  run = RUN_WINDOWS * SEQ_LEN
  for r, record in enumerate(records):
    length = int(record["length"])
    np.testing.assert_array_equal(record["tokens"][:length], stream[r * run : r * run + length])
    np.testing.assert_array_equal(record["loss_mask"][:length], stream_mask[r * run :][:length])
  # Every window's target mask: the reference's mask of each target token.
  windows = -(-len(stream) // SEQ_LEN)
  which = np.arange(windows)
  rows = packed.packed_batch(SEQ_LEN)([records[w // RUN_WINDOWS] for w in which], which % 2)
  for w in which:
    lo = w * SEQ_LEN
    expected = np.zeros(SEQ_LEN)
    real = stream_mask[lo + 1 : lo + SEQ_LEN + 1]
    expected[: len(real)] = real
    np.testing.assert_array_equal(rows["mask"][w], expected, err_msg=f"window {w}")
    np.testing.assert_array_equal(rows["targets"][w][: len(real)], stream[lo + 1 :][: len(real)])
  assert rows["mask"].sum() == sum(m.sum() for m in masks)
  # Segments and positions as for pretraining data: each example its own segment.
  assert rows["segment_ids"][0][0] == 1 and rows["positions"][0][0] == 0


def test_a_packed_rows_loss_is_the_sum_of_its_examples_losses_alone(tmp_path, tokenizer):
  """One window holds every example; the tiny model is made here (no training to share)."""
  ids, masks = _reference(tokenizer)
  seq_len = sum(len(i) for i in ids) + 3  # every example in window 0, padding after
  prepared = _prepare(tmp_path, _write(tmp_path / "a.jsonl", ROWS), tokenizer, seq_len=seq_len)
  records = open_source(prepared.name, TRAIN, str(tmp_path / "data"), None)
  row = packed.packed_batch(seq_len)([records[0]], np.array([0]))
  assert row["segment_ids"].max() == len(ROWS)
  model = TransformerLM(
    TransformerConfig(
      seq_len=seq_len, vocab_size=400, num_layers=2, d_model=32, num_heads=2, d_ff=64
    ),
    rngs=nnx.Rngs(0),
  )
  alone = {"inputs": [], "targets": [], "mask": []}
  for example, mask in zip(ids, masks):
    pad = seq_len + 1 - len(example)
    alone["inputs"].append(np.pad(example[:-1], (0, pad)))
    alone["targets"].append(np.pad(example[1:], (0, pad)))
    alone["mask"].append(np.pad(mask[1:], (0, pad)).astype(np.float32))
  alone = {key: np.stack(value) for key, value in alone.items()}
  loss, weight, _ = lm.next_token_loss(model, row, None, False)
  loss_alone, weight_alone, _ = lm.next_token_loss(model, alone, None, False)
  assert float(weight) == float(weight_alone) == sum(m.sum() for m in masks)
  np.testing.assert_allclose(loss, loss_alone, rtol=1e-5)
  # With every target of the examples counted (the pretraining mask), the loss is another.
  everything = dict(row, mask=(row["segment_ids"][:, :] > 0).astype(np.float32))
  assert not np.isclose(lm.next_token_loss(model, everything, None, False)[0], loss, rtol=1e-3)


@pytest.mark.parametrize(
  "bad, reason",
  [
    ({"prompt": "p"}, "line 2: has no 'completion' field"),
    ({"completion": "c"}, "line 2: has no 'prompt' field"),
    ({"prompt": 3, "completion": "c"}, "line 2: 'prompt' is a number, not a string"),
    ({"prompt": "p", "completion": None}, "line 2: 'completion' is a null, not a string"),
  ],
)
def test_a_row_without_a_string_prompt_and_completion_is_named_and_can_be_skipped(
  tmp_path, tokenizer, bad, reason
):
  spec = _write(tmp_path / "a.jsonl", [ROWS[0], bad, ROWS[1]])
  with pytest.raises(SourceError, match=f"a.jsonl {reason}"):
    _prepare(tmp_path, spec, tokenizer)
  prepared = _prepare(tmp_path, spec, tokenizer, skip_bad_rows=1)
  assert (prepared.documents, prepared.bad_rows) == (2, 1)
  assert reason in prepared.note()


def test_the_format_is_checked_up_front():
  from configs import llama_tiny
  from spmd.errors import UserError
  from trainers.tasks import lm_data

  config = llama_tiny.get_config()
  config.data.format = "prompt_completion"
  with pytest.raises(ValueError, match="data.format='prompt_completion' reads data.sources"):
    lm_data.check_data(config, config.model.vocab_size)
  config.data.sources = "sft/*.jsonl"
  config.data.format = "chat"
  with pytest.raises(UserError, match="data.format='chat' must be 'text' or 'prompt_completion'"):
    lm_data.check_data(config, config.model.vocab_size)
