"""What runs on the devices: the mesh from the config, the sharded train state, the optimizer, and the compiled train and eval steps.

state.py         the train state, created directly sharded on the global mesh
optim.py         the optimizer from the config: optax by name, a schedule, clipping, a decay mask
steps.py         the train and eval steps: one `sharded_jit` each
task_metrics.py  the metric names the trainer keeps for itself, and the task's, found up front
"""
