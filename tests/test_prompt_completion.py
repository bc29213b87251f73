"""Prompt/completion data (`config.data.format="prompt_completion"`, issue 45 item 4; issue 59:
defect 8): each JSONL row packed as the tokenizer's tokens of BOS + prompt + completion + EOS, with a
loss mask on every token that holds completion text and on the EOS, checked token by token against
a reference that finds the boundary by decoding; for each tokenizer family users bring
(`tests/tokenizer_families.py`), prompts that end in a space and completions that start without one;
`hypothesis` properties for any row and for the packer; a packed row's loss is the sum of its
examples' losses alone; bad rows are named by file and line. In-process."""

import json
import tempfile

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests import tokenizer_families
from trainers.data.prepare import packed, source_packed, source_shards
from trainers.data.prepare import tokenizer as tok
from trainers.data.prepare.documents import Document
from trainers.data.prepare.holdout import TRAIN
from trainers.data.prepare.source_files import SourceError, SourceFile, SourceSpec, list_source
from trainers.data.records.datasets import open_source
from trainers.models.transformer import TransformerConfig, TransformerLM
from trainers.tasks import lm

SEQ_LEN, RUN_WINDOWS = 16, 2
# Prompts that end in a space: tokenized with their completion, the space
# and the completion's first word merge into one BPE token, which holds
# completion text and so counts in the loss.
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


def _prompt_ids(tokenizer, prompt: str, ids) -> tuple[int, int]:
  """How many of a row's ids (BOS left out) hold prompt text only: at least, at most.

  Found by decoding the ids' prefixes, not from the tokenizer's offsets, so
  that the reference does not repeat the packer. Where each id adds text
  the two are equal. Ids that add none (a dummy prefix) may go either way,
  and a character split into bytes decodes (to U+FFFD) only when whole, so
  the boundary is known to within the ids of the prompt's last character
  and the completion's first.
  """
  ids = [int(i) for i in ids]
  texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
  clean = [i for i, text in enumerate(texts) if "\ufffd" not in text]  # rows hold no U+FFFD
  within = [i for i in clean if len(texts[i]) <= len(prompt)]
  assert prompt.startswith(texts[within[-1]]), (prompt, texts)
  at_least = min(i for i in within if texts[i] == texts[within[-1]])
  past = [i for i in clean if len(texts[i]) > len(prompt)]
  return at_least, (past[0] - 1 if past else len(ids))


def _reference(tokenizer, rows=ROWS) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Each row's ids and loss mask: the whole row's tokens, 0s for BOS and the prompt's, 1s after."""
  ids, masks = [], []
  for row in rows:
    whole = tokenizer.encode(row["prompt"] + row["completion"])
    at_least, at_most = _prompt_ids(tokenizer, row["prompt"], whole)
    assert at_least == at_most, row  # rows whose boundary decoding finds
    ids.append(np.array([tokenizer.bos_id, *whole, tokenizer.eos_id]))
    masks.append(np.array([0] * (1 + at_least) + [1] * (len(whole) - at_least + 1)))
  return ids, masks


def test_each_token_is_masked_as_the_reference_and_the_boundary_is_exact(tmp_path, tokenizer):
  apart = [tokenizer.encode(r["prompt"]) + tokenizer.encode(r["completion"]) for r in ROWS]
  together = [tokenizer.encode(r["prompt"] + r["completion"]) for r in ROWS]
  assert apart != together  # so the test tells a packer that tokenized them apart
  prepared = _prepare(tmp_path, _write(tmp_path / "a.jsonl", ROWS), tokenizer)
  assert prepared.documents == len(ROWS)
  records = open_source(prepared.name, TRAIN, str(tmp_path / "data"), None)
  records = [records[i] for i in range(len(records))]
  ids, masks = _reference(tokenizer)
  stream, stream_mask = np.concatenate(ids), np.concatenate(masks)
  # The loss counts the completion's text, with the prompt's trailing space where one token
  # holds both (" four").
  for row, example, mask in zip(ROWS, ids, masks):
    counted = tokenizer.decode(example[(mask == 1)][:-1])
    assert counted.endswith(row["completion"]) and len(counted) <= len(row["completion"]) + 1
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


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tok.Tokenizer]:
  folder = tmp_path_factory.mktemp("families")
  return {
    name: tok.Tokenizer(tokenizer_families.tokenizer_file(name, folder))
    for name in tokenizer_families.FAMILIES
  }


def _examples(tokenizer, rows) -> list[packed.Example]:
  file = SourceFile("rows.jsonl", "rows.jsonl", "jsonl", 0, "")
  read = [Document(file, n + 1, r["completion"], prompt=r["prompt"]) for n, r in enumerate(rows)]
  return list(source_packed._example_ids(read, tokenizer))


@pytest.mark.parametrize(
  "family, prompt, completion, tokens, mask",
  [
    # Llama 2 / Mistral: no stray "▁" between the prompt and a completion that starts with a space.
    ("prepend", "The capital is", " Paris.", ["▁The", "▁capital", "▁is", "▁Paris."], [0, 0, 0, 1]),
    (
      "metaspace",
      "The capital is",
      " Paris.",
      ["▁The", "▁capital", "▁is", "▁Paris."],
      [0, 0, 0, 1],
    ),
    # ... nor a doubled one after a prompt that ends in a space: "▁Paris." holds that space.
    ("prepend", "The capital is ", "Paris.", ["▁The", "▁capital", "▁is", "▁Paris."], [0, 0, 0, 1]),
    (
      "metaspace",
      "The capital is ",
      "Paris.",
      ["▁The", "▁capital", "▁is", "▁Paris."],
      [0, 0, 0, 1],
    ),
    (
      "sentencepiece",
      "The capital is ",
      "Paris.",
      ["▁The", "▁capital", "▁is", "▁", "P", "ar", "is", "."],
      [0, 0, 0, 0, 1, 1, 1, 1],
    ),
    # A space token that ends the prompt is the prompt's, though GPT-2's file trims its offsets.
    ("gpt2", "x ", "\n", ["x", "Ġ", "Ċ"], [0, 0, 1]),
    # Llama 3 / Qwen2, and the project's BPE: " Paris" is one token, whichever side has the space.
    (
      "byte_level",
      "The capital is ",
      "Paris.",
      ["The", "Ġcapital", "Ġis", "ĠParis", "."],
      [0, 0, 0, 1, 1],
    ),
    (
      "own_bpe",
      "The capital is",
      " Paris.",
      ["The", "Ġcapital", "Ġis", "ĠParis", "."],
      [0, 0, 0, 1, 1],
    ),
  ],
)
def test_a_row_is_the_tokenizers_tokens_of_its_whole_text(
  families, family, prompt, completion, tokens, mask
):
  tokenizer = families[family]
  [example] = _examples(tokenizer, [{"prompt": prompt, "completion": completion}])
  assert tokenizer_families.token_names(tokenizer, example.tokens[1:-1]) == tokens
  assert [example.tokens[0], example.tokens[-1]] == [tokenizer.bos_id, tokenizer.eos_id]
  assert example.loss_mask.tolist() == [0, *mask, 1]


# Words, spaces, line breaks and characters a byte-level BPE splits into bytes.
TEXTS = st.lists(
  st.sampled_from(
    [
      "The",
      " capital",
      " is",
      "is",
      " ",
      "  ",
      "Paris",
      ".",
      "\n",
      "\n\n",
      "\t",
      "é",
      "東京",
      "Ω",
      "😀",
      "12345",
    ]
  ),
  max_size=6,
).map("".join)


@pytest.mark.parametrize("family", tokenizer_families.FAMILIES)
@settings(
  max_examples=50,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(prompt=TEXTS, completion=TEXTS)
def test_any_rows_tokens_are_its_whole_texts_and_the_loss_starts_at_the_completions_text(
  families, family, prompt, completion
):
  tokenizer = families[family]
  text = prompt + completion
  assume(tokenizer.decode(tokenizer.encode(text)) == text)  # so decoding finds the boundary
  [example] = _examples(tokenizer, [{"prompt": prompt, "completion": completion}])
  whole = tokenizer.encode(text)
  np.testing.assert_array_equal(example.tokens, [tokenizer.bos_id, *whole, tokenizer.eos_id])
  # BOS and the prompt's ids 0, then 1 on every id to the EOS.
  prompt_ids = len(whole) - int(example.loss_mask[1:-1].sum())
  want = [0] * (1 + prompt_ids) + [1] * (len(whole) - prompt_ids + 1)
  np.testing.assert_array_equal(example.loss_mask, want)
  at_least, at_most = _prompt_ids(tokenizer, prompt, whole)
  assert at_least <= prompt_ids <= at_most, (at_least, prompt_ids, at_most)


@st.composite
def packed_examples(draw) -> tuple[list[packed.Example], int, int]:
  """Examples of any lengths and masks, and a window and a record size to pack them in."""
  examples = []
  for _ in range(draw(st.integers(1, 6))):
    length = draw(st.integers(1, 12))
    tokens = draw(st.lists(st.integers(3, 399), min_size=length, max_size=length))
    mask = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
    examples.append(packed.Example(np.array(tokens, np.int64), np.array(mask, np.uint8)))
  return examples, draw(st.integers(2, 9)), draw(st.integers(1, 3))


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(drawn=packed_examples())
def test_a_packed_rows_tokens_and_mask_are_its_examples(drawn):
  """Packed by the source's packer and read back: every row against the examples' own stream."""
  examples, seq_len, run_windows = drawn
  with tempfile.TemporaryDirectory() as root:
    folder = f"{root}/{source_packed.NAME}/drawn/{source_packed.VERSION}"
    layout = source_shards.ShardLayout(
      seq_len=seq_len, run_windows=run_windows, vocab_size=400, split=TRAIN, loss_mask=True
    )
    source_shards.prepare_shards(folder, [1], lambda i: (examples, dict), lambda notes: {}, layout)
    records = open_source(f"{source_packed.NAME}/drawn:{source_packed.VERSION}", TRAIN, root)
    records = [records[i] for i in range(len(records))]
  stream = np.concatenate([e.tokens for e in examples])
  counted = np.concatenate([e.loss_mask for e in examples])
  owner = np.concatenate([np.full(len(e.tokens), n) for n, e in enumerate(examples)])
  windows = -(-len(stream) // seq_len)
  which = np.arange(windows)
  rows = packed.packed_batch(seq_len)(
    [records[w // run_windows] for w in which], which % run_windows
  )
  for w in which:
    at = np.arange(w * seq_len, (w + 1) * seq_len)  # the inputs' places in the stream
    real, target = at < len(stream), at + 1 < len(stream)
    here, after = np.minimum(at, len(stream) - 1), np.minimum(at + 1, len(stream) - 1)
    inputs, targets = np.where(real, stream[here], 0), np.where(target, stream[after], 0)
    # A target counts when it is the input's example's, and marked.
    mask = target & (owner[after] == owner[here]) & (counted[after] == 1)
    # Segments: the row's examples numbered from 1 in order; positions count within each.
    segments = np.where(real, owner[here] - owner[here][0] + 1, 0)
    first = np.array([np.argmax(owner[here] == m) for m in owner[here]])
    positions = np.where(real, np.arange(seq_len) - first, 0)
    for key, want in [
      ("inputs", inputs),
      ("targets", targets),
      ("mask", mask),
      ("segment_ids", segments),
      ("positions", positions),
    ]:
      np.testing.assert_array_equal(rows[key][w], want, err_msg=f"{key} of window {w}")


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
