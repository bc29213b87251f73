"""One run preparing a `text_corpus` alone, beside another run on the same data.dir.

Usage: prepare_text_corpus_beside_worker.py SOURCE DATA_DIR GO_FILE

(tests/test_text_corpus.py). Prepares the corpus of SOURCE (a folder) as
`spmd-train` does for `data.text_source`, starting once GO_FILE exists, so
that two runs started side by side prepare at the same moment, as a
sweep's runs do. Prints the dataset's name.
"""

import pathlib
import sys
import time

from trainers.data.prepare import text_corpus

source, data_dir, go = sys.argv[1:4]
while not pathlib.Path(go).exists():
  time.sleep(0.01)
print(text_corpus.prepare_text_corpus(data_dir, source, chunk_bytes=64, validation_percent=50))
