"""Preparing data: sources -> records on disk.

  source_files.py   `config.data.sources`: the sources, their files and identities
  documents.py      each format's documents, streamed; bad rows named by file and row
  holdout.py        which split a file or document goes to (a hash of its key)
  tokenizer.py      BPE trained on the data, or a user's tokenizer file
  token_codec.py    text <-> ids for prompts and samples
  text_corpus.py    the `text_corpus` TFDS builder: byte-level LM data from local
                    text files; `prepare_text_corpus` builds (or reuses) it
  packed.py         `packed_lm`: documents tokenized and packed into windows
  source_packed.py  `packed_source`: one split of one source, packed
  source_shards.py  a packed dataset prepared by a group of processes, each its share
  prepare_group.py  the processes that prepare data together (which, how many, how they wait)
  preparation_lock.py  one run at a time prepares a dataset in a shared data.dir
  blobs.py          `blobs`: a generated classification dataset (the MLP config)

What it writes, and reads back where one preparation builds on another, is
the record format (`trainers.data.records.plan`); it never imports
`trainers.data.read`. Nothing is imported here.
"""
