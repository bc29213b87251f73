"""Planning a run ahead of time: the real train step compiled for a target, and what it needs.

plan.py      `make_plan`: compile the step for a TPU slice or GPUs, read memory, FLOPs, collectives
targets.py   what a plan is for: a TPU slice by name, or GPUs of a kind
advice.py    what would make a plan (or a run's step) that does not fit fit
report.py    the plan as a table; `plan_cli.py` is `spmd-plan`
"""
