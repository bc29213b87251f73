"""Which split a document or file goes to: a hash of its key, so adding data never moves others.

The text corpus holds out files by the key of each file; a source of
`config.data.sources` holds out documents by the key of each document (its
file's key and its row). Either way a key's split never changes when other
keys are added, and every host derives the same split from the same names.

Example:
  >>> split_of("os.py"), split_of("os.py", validation_percent=100)
  ('train', 'validation')
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

DEFAULT_VALIDATION_PERCENT = 2.0
TRAIN = "train"
VALIDATION = "validation"
# Split assignment resolution: validation_percent is honoured to 0.01 %.
_HASH_BUCKETS = 10_000


def _bucket(key: str) -> int:
  digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
  return int.from_bytes(digest[:8], "big") % _HASH_BUCKETS


def split_of(key: str, validation_percent: float = DEFAULT_VALIDATION_PERCENT) -> str:
  """The split ("train" or "validation") of the file or document with this key.

  A hash, not the position, decides, so adding files or rows never moves others.

  >>> split_of("a.jsonl#3", 0), split_of("a.jsonl#3", 100)
  ('train', 'validation')
  """
  return VALIDATION if _bucket(key) < validation_percent * (_HASH_BUCKETS / 100) else TRAIN


def validation_percent_to_hold_out(keys: Sequence[str]) -> float:
  """The least `validation_percent` that puts one of these keys in validation.

  >>> percent = validation_percent_to_hold_out(["os.py", "re.py"])
  >>> "validation" in {split_of(k, percent) for k in ["os.py", "re.py"]}
  True
  """
  if not keys:
    raise ValueError("no files to hold out")
  return (min(_bucket(k) for k in keys) + 1) / (_HASH_BUCKETS / 100)
