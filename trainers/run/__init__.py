"""The run itself: `spmd-train` from config to summary, the loop, and what guards it.

train.py       `train_and_evaluate`: the whole run, as numbered steps; `train_cli.py` is `spmd-train`
loop.py        the training loop: steps, and the hooks due after each
startup.py     what a run sets up once: its files, the compilation cache, the placement log
evaluate.py    `spmd-train --mode=eval`: a saved checkpoint evaluated on any number of hosts
watchdog.py    a job whose steps stop advancing ends, naming who stopped
preemption.py  SIGTERM means "save at a step every host agrees on, then exit 0"
out_of_memory.py  a step the devices cannot hold ends in one line, with the plan's advice
"""
