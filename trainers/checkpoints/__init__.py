"""Checkpoints and what reads them back: saving and restoring the train state, judging step folders, a saved run's config and weights, export.

checkpoint.py    orbax saves (asynchronous, atomic, the data position inside), restore, warm start
step_folders.py  which step folders are checkpoints, the harness's unfinished saves, or another tool's
saved_run.py     a run's resolved config and its checkpoints' weights, read back
export.py        the trained weights as one plain-array file; `export_cli.py` is `spmd-export`
"""
