"""The data path, in two rooms that meet only in the record format.

  prepare/   sources -> records on disk: your files listed and read, tokenized,
             packed, written as a prepared dataset (by one process or a group)
  read/      records on disk -> step-indexed global batches: each split an
             endless seeded stream, weighted mixtures, each host its own rows
  records/   the record format both rooms share: what a prepared split's
             records hold, their stored lengths, the split opened as a
             random-access source (its shards staged and ordered when remote)

`prepare/` and `read/` never import each other; both import `records/`, which
imports neither (tests/test_layers.py holds this). Nothing is imported here,
so `import trainers.data` does not pay for TFDS.
"""
