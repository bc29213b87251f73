"""The data pipeline.

  source_files.py   `config.data.sources`: the sources, their files and identities
  documents.py      each format's documents, streamed; bad rows named by file and row
  holdout.py        which split a file or document goes to (a hash of its key)
  text_corpus.py    the `text_corpus` TFDS builder: byte-level LM data from local text files
  packed.py         `packed_lm`: documents tokenized and packed into windows
  source_packed.py  `packed_source`: one split of one source, packed
  source_shards.py  a packed dataset prepared by a group of processes, each its share
  prepare_group.py  the processes that prepare data together (which, how many, how they wait)
  preparation_lock.py  one run at a time prepares a dataset in a shared data.dir
  blobs.py          `blobs`: a generated classification dataset (the MLP config)
  datasets.py       `open_source`: any prepared TFDS dataset as a random-access source;
                    `prepare_text_corpus`: build (or reuse) the text corpus
  tokenizer.py      BPE trained on the data, or a user's tokenizer file
  token_codec.py    text <-> ids for prompts and samples
  records.py        what a split's records hold (`RecordPlan`)
  record_order.py   the seeded permutations of a stream
  record_stream.py  one split's examples as an endless seeded stream
  pipeline.py       step-indexed global batches, each host its own rows
  mixture_rows.py   which source each row of a weighted mixture comes from
  mixture.py        global batches drawn from several sources by weight
  lm_examples.py    next-token windows of token records

Nothing is imported here, so `import trainers.data` does not pay for TFDS.
"""
