"""The tokenizer families users bring, built here with the `tokenizers` library (tests download nothing).

Each is shaped like the real family's `tokenizer.json`, trained on a small
text of code and prose so that it has the merges that make cuts and
boundaries hard (whitespace runs, "\\n\\n", a word with its leading space):

  byte_level    Llama 3 / Qwen2: a Split on Llama 3's regex, then ByteLevel
                without a prefix space; `<|begin_of_text|>` / `<|end_of_text|>`
  gpt2          GPT-2 (and the models that kept its file's shape): ByteLevel
                with its own regex, and a ByteLevel post-processor that trims
                spaces from the tokens' offsets; `<|endoftext|>` for both
  prepend       Llama 2 / Mistral as converted from SentencePiece: a Prepend("▁")
                and Replace(" ", "▁") normalizer, no pre-tokenizer, byte fallback
                (`<0x0A>` for a line break); `<s>` / `</s>`
  metaspace     the same model behind a Metaspace pre-tokenizer that prepends
                "▁" to the text's first word only (`prepend_scheme="first"`)
  own_bpe       the project's own byte-level BPE (`train_bpe`), whose vocabulary
                holds "\\n\\n" and runs of spaces
  sentencepiece a SentencePiece `.model` as Llama 2's is trained: BPE, byte
                fallback, a dummy prefix, digits split, text not normalized

`tokenizer_file(name, folder)` writes one (a `tokenizer.json`, or the
`.model`); the trained models are made once per process.
"""

import functools
import io
import json
import pathlib
import tempfile
import textwrap

import sentencepiece
from tokenizers import (
  Regex,
  Tokenizer,
  decoders,
  models,
  normalizers,
  pre_tokenizers,
  processors,
)
from tokenizers import trainers as hf_trainers

from trainers.data.prepare.tokenizer import train_bpe

FAMILIES = ("byte_level", "gpt2", "prepend", "metaspace", "own_bpe", "sentencepiece")
SPACE = "▁"
# Llama 3's pre-tokenizer pattern (Qwen2's differs only in single digits).
LLAMA3_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
VOCAB = 700

# Code with blank lines, indentation and CRLF, and prose with non-ASCII text:
# what a corpus holds and what merges across line breaks.
CODE = textwrap.dedent(
  '''\
  import os


  class Reader:
      """Reads a file, line by line."""

      def __init__(self, path):
          self.path = path
          self.count = 0

      def lines(self):
          with open(self.path) as f:
              for line in f:
                  self.count += 1
                  yield line.rstrip("\\n")


  def main(argv=None):
      reader = Reader(argv[1])
      for line in reader.lines():
          print(line)
      return 0
  '''
)
PROSE = (
  "The capital is Paris. The capital of Italy is Rome.\r\n"
  "Question: what is two plus two? Answer: four.\r\n"
  "Naïve café résumé — über straße, 東京 and Zürich.\n"
  "\n"
  "A paragraph after a blank line, then   three spaces, then\ta tab.\n"
)
TRAINING_TEXT = (CODE + "\n\n" + PROSE) * 8


@functools.cache
def _byte_level_json(gpt2: bool) -> str:
  if gpt2:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    specials = ["<|endoftext|>"]
  else:
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
      ]
    )
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
  tok.decoder = decoders.ByteLevel()
  trainer = hf_trainers.BpeTrainer(
    vocab_size=VOCAB,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator([TRAINING_TEXT], trainer)
  return tok.to_str()


@functools.cache
def _sentencepiece_model() -> dict:
  """A SentencePiece-style BPE (the model part of a Llama 2 `tokenizer.json`): `▁` for spaces."""
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  # Merges within words, each with its leading "▁", as SentencePiece trains.
  tok.pre_tokenizer = pre_tokenizers.Metaspace(SPACE, prepend_scheme="always", split=True)
  # Lines apart, so that a line break is no character of the vocabulary (it is `<0x0A>`).
  lines = [line for line in TRAINING_TEXT.replace("\r\n", "\n").split("\n") if line]
  trainer = hf_trainers.BpeTrainer(
    vocab_size=VOCAB,
    special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))],
    show_progress=False,
  )
  tok.train_from_iterator(lines, trainer)
  model = json.loads(tok.to_str())["model"]
  model.update(byte_fallback=True, fuse_unk=True)
  return model


def _sentencepiece_json(metaspace: bool) -> str:
  decoder = decoders.Sequence(
    [
      decoders.Replace(SPACE, " "),
      decoders.ByteFallback(),
      decoders.Fuse(),
      decoders.Strip(" ", 1, 0),
    ]
  )
  tok = Tokenizer(models.BPE())
  if metaspace:
    tok.pre_tokenizer = pre_tokenizers.Metaspace(SPACE, prepend_scheme="first", split=False)
  else:
    tok.normalizer = normalizers.Sequence(
      [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
    )
  tok.decoder = decoder
  spec = json.loads(tok.to_str())
  spec["model"] = _sentencepiece_model()
  specials = ["<unk>", "<s>", "</s>"]
  spec["added_tokens"] = [
    {
      "id": spec["model"]["vocab"][name],
      "content": name,
      "single_word": False,
      "lstrip": False,
      "rstrip": False,
      "normalized": False,
      "special": True,
    }
    for name in specials
  ]
  return json.dumps(spec)


@functools.cache
def _own_bpe_json() -> str:
  with tempfile.TemporaryDirectory() as folder:
    path = train_bpe([TRAINING_TEXT], VOCAB, pathlib.Path(folder) / "tokenizer.json")
    text = path.read_text()
  vocab = json.loads(text)["model"]["vocab"]
  # The merges that make cutting a file hard: a blank line's "\n\n" and runs of spaces.
  assert {"ĊĊ", "ĠĠĠ"} <= vocab.keys(), sorted(k for k in vocab if set(k) <= {"Ċ", "Ġ"})
  return text


@functools.cache
def _sentencepiece_bytes() -> bytes:
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
    sentence_iterator=iter([line for line in TRAINING_TEXT.split("\n") if line]),
    model_writer=model,
    vocab_size=400,
    model_type="bpe",
    byte_fallback=True,
    split_digits=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=True,
    character_coverage=1.0,
    minloglevel=2,
  )
  return model.getvalue()


def tokenizer_json(name: str) -> str:
  """The `tokenizer.json` text of family `name` (one of `FAMILIES`)."""
  if name in ("byte_level", "gpt2"):
    return _byte_level_json(gpt2=name == "gpt2")
  if name in ("prepend", "metaspace"):
    return _sentencepiece_json(metaspace=name == "metaspace")
  if name == "own_bpe":
    return _own_bpe_json()
  raise ValueError(f"{name=} is not one of {FAMILIES}")


def tokenizer_file(name: str, folder: pathlib.Path) -> pathlib.Path:
  """Writes family `name`'s file (a `tokenizer.json`, or a SentencePiece `.model`) into `folder`."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  if name == "sentencepiece":
    path = folder / "sentencepiece.model"
    path.write_bytes(_sentencepiece_bytes())
    return path
  path = folder / f"{name}-tokenizer.json"
  path.write_text(tokenizer_json(name))
  return path


def token_names(tokenizer, ids) -> list[str]:
  """The vocabulary's names of `ids` for a `trainers.data.prepare.tokenizer.Tokenizer`, for messages."""
  if tokenizer.kind == "sentencepiece":
    return [tokenizer._sp.id_to_piece(int(i)) for i in ids]
  return [tokenizer._hf.id_to_token(int(i)) for i in ids]
