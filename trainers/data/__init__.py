"""The data pipeline.

  text_corpus.py  the `text_corpus` TFDS builder: byte-level LM data from local text files
  datasets.py     `open_source`: any prepared TFDS dataset as a random-access source;
                  `prepare_text_corpus`: build (or reuse) the text corpus

Nothing is imported here, so `import trainers.data` does not pay for TFDS.
"""
