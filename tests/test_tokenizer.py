"""Tokenizers: a BPE trained on a small corpus and cached, a user's tokenizer.json and a
SentencePiece model loaded, identities as file hashes, and the checks made up front."""

import hashlib
import io
import os

import pytest

from configs import lm_tiny
from tests import tokenizer_families
from trainers import config as config_lib
from trainers.data.prepare import tokenizer as tok
from trainers.tasks import lm, lm_data

TEXT = "def f(x):\n  return x + 1  # ünïcödé, tabs\tand emoji 🙂\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("tok_corpus")
  paths = []
  for i in range(6):
    path = root / f"doc_{i}.py"
    path.write_text(f"# file {i}\n" + "def add(a, b):\n  return a + b\n" * (10 + i) + TEXT)
    paths.append(str(path))
  return paths


def test_bpe_trains_once_reserves_specials_and_round_trips(files, tmp_path):
  first = tok.bpe_tokenizer(tmp_path, "key", files, 300)
  assert (first.bos_id, first.eos_id) == (1, 2) and first.vocab_size <= 300
  assert first.encode("<pad>") != [0]  # the reserved ids are never text
  stamp = os.stat(first.path).st_mtime_ns
  again = tok.bpe_tokenizer(tmp_path, "key", files, 300)
  assert again.path == first.path and os.stat(again.path).st_mtime_ns == stamp  # not retrained
  assert again.identity == first.identity == tok.file_identity(open(first.path, "rb").read())
  for text in (TEXT, "", "  leading spaces\r\n", bytes(range(128, 256)).decode("latin-1")):
    assert first.decode(first.encode(text)) == text
  assert tok.bpe_tokenizer(tmp_path, "key", files, 400).path != first.path  # another vocab


def test_a_users_tokenizer_json_is_copied_and_its_markers_found(files, tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  hf = Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  hf.train(
    files,
    trainers.BpeTrainer(
      vocab_size=280,
      special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
    ),
  )
  path = tmp_path / "mine" / "tokenizer.json"
  path.parent.mkdir()
  hf.save(str(path))
  loaded = tok.user_tokenizer(str(path), tmp_path / "data")
  assert loaded.path != str(path) and loaded.path.startswith(str(tmp_path / "data"))
  assert loaded.identity == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
  assert loaded.bos_id == loaded.eos_id == 0 and not loaded.missing  # GPT-2 style
  assert loaded.decode(loaded.encode(TEXT)) == TEXT


def test_a_sentencepiece_model_loads_with_its_bos_and_eos(files, tmp_path):
  import sentencepiece

  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
    sentence_iterator=iter(open(files[0]).read().splitlines() * 3),
    model_writer=model,
    vocab_size=300,
    model_type="bpe",
    byte_fallback=True,
    minloglevel=2,
  )
  path = tmp_path / "sp.model"
  path.write_bytes(model.getvalue())
  loaded = tok.user_tokenizer(str(path), tmp_path / "data")
  assert loaded.kind == "sentencepiece" and (loaded.bos_id, loaded.eos_id) == (1, 2)
  assert loaded.identity == tok.file_identity(path.read_bytes())
  assert loaded.decode(loaded.encode("def add(a, b):")) == "def add(a, b):"


def test_a_tokenizer_without_markers_says_so(tmp_path):
  from tokenizers import Tokenizer, models

  path = tmp_path / "bare.json"
  Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
  loaded = tok.Tokenizer(path)
  assert loaded.bos_id is None and "has no BOS and no EOS token" in loaded.missing


def test_the_config_check_names_the_key_and_value(files, tmp_path):
  config = lm_tiny.get_config()
  config.data.tokenizer = str(tmp_path / "missing.json")
  with pytest.raises(ValueError, match=r"data.tokenizer='.*missing.json' is not 'bytes'"):
    config_lib.resolve(config)
  path = tok.bpe_tokenizer(tmp_path, "k", files, 300).path
  config.data.tokenizer, config.data.pack, config.model.vocab_size = path, True, 256
  with pytest.raises(ValueError, match=r"config.model.vocab_size=256 is smaller than"):
    config_lib.resolve(config)
  config.data.tokenizer, config.model.vocab_size = "bpe", 1024
  config.data.pack = False
  with pytest.raises(ValueError, match=r"needs data.pack=True on the text corpus"):
    config_lib.resolve(config)
  config.data.pack, config.model.vocab_size = True, 200
  with pytest.raises(ValueError, match=r"vocab_size=200 is too small for data.tokenizer='bpe'"):
    config_lib.resolve(config)
  config.model.vocab_size = 1024
  assert config_lib.resolve(config).data.tokenizer == "bpe"
  assert lm.make_task(config).count_units is lm_data.real_tokens


def test_a_saved_run_decodes_with_its_own_copy_when_the_original_is_gone(files, tmp_path):
  from trainers.checkpoints import saved_run

  original = tmp_path / "gone" / "tokenizer.json"
  tok.train_bpe(open(files[0]).read().splitlines(), 300, original)
  config = lm_tiny.get_config()
  config.data.tokenizer, config.data.pack, config.model.vocab_size = str(original), True, 300
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(config_lib.resolve(config).to_json())
  (workdir / "tokenizer.json").write_bytes(original.read_bytes())  # what the run keeps
  original.unlink()
  assert saved_run.saved_config(workdir).data.tokenizer == str(workdir / "tokenizer.json")


@pytest.mark.multiprocess
def test_a_tokenizer_file_on_cloud_storage_is_copied_into_the_data_dir(
  files, tmp_path, monkeypatch
):
  """data.tokenizer=gs://...: a local GCS emulator serves it; the run reads the local copy."""
  from etils import epath

  from tests.gcs_emulator import serving

  with serving(tmp_path / "gcs", monkeypatch):
    local = tok.train_bpe((open(f).read() for f in files), 300, tmp_path / "t" / "tokenizer.json")
    url = "gs://bucket/tokenizers/tokenizer.json"
    epath.Path(url).write_bytes(local.read_bytes())
    tok.check_spec(url)  # the config check reads URLs as paths
    found = tok.user_tokenizer(url, tmp_path / "data")
    assert found.path.startswith(str(tmp_path / "data" / tok.CACHE_DIR))
    assert found.identity == tok.file_identity(local.read_bytes())
    assert found.decode(found.encode(TEXT)) == TEXT
    with pytest.raises(FileNotFoundError, match=r"data.tokenizer='gs://bucket/missing.json'"):
      tok.user_tokenizer("gs://bucket/missing.json", tmp_path / "data")


@pytest.mark.parametrize("family", tokenizer_families.FAMILIES)
def test_many_texts_at_once_are_each_texts_own_ids(family, tmp_path):
  """`encode_batch` (which packing uses, without offsets) gives `encode`'s ids, text by text."""
  tokenizer = tok.Tokenizer(tokenizer_families.tokenizer_file(family, tmp_path))
  texts = [TEXT, " The capital is Paris.\r\n\n\nNext", "<s> is text here\n\n  x", "", "ünï 🙂 "]
  assert [ids.tolist() for ids in tokenizer.encode_batch(texts)] == [
    tokenizer.encode(t) for t in texts
  ]
  with_offsets = tokenizer.encode_batch_with_offsets(texts)
  assert [ids.tolist() for ids, _ in with_offsets] == [tokenizer.encode(t) for t in texts]
