"""What runs on the devices: the mesh from the config, the sharded train state, the optimizer, and the compiled train and eval steps.

mesh.py                the run's mesh and the axes that split the batch
state.py               the train state, created directly sharded on the global mesh
trainable.py           which parameters train: all, or (LoRA) the adapters, the rest frozen
optim.py               the optimizer from the config: optax by name, a schedule, clipping, a decay mask
loss.py                the task's loss as the steps call it, on the model rebuilt from the state
train_step.py          the train step: gradients, the update if finite, metrics; one `sharded_jit`
gradient_reduction.py  GSPMD's gradient reductions, or one flat vector across CPU hosts
eval_step.py           the eval step: the task's sums in eval mode
task_metrics.py        the metric names the trainer keeps for itself, and the task's, found up front
"""
