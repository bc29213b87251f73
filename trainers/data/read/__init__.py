"""Reading data: records on disk -> step-indexed global batches, each host its own rows.

  pipeline.py       step-indexed global batches, each host its own rows
  record_stream.py  one split's examples as an endless seeded stream
  mixture_rows.py   which source each row of a weighted mixture comes from
  mixture.py        global batches drawn from several sources by weight
  lm_examples.py    next-token windows of token records

A prepared split reaches it only through the record format
(`trainers.data.records.plan`: `datasets.open_source`, `plan.RecordPlan`); it
never imports `trainers.data.prepare`. Nothing is imported here.
"""
