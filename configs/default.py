"""The default experiment config; other configs import it and change a few fields.

  spmd-mesh --config=configs/default.py --config.mesh.ici=data=-1,tensor=2

Unknown keys are rejected (the ConfigDict is locked by the flag parser), so a
typo in an override is an error, not a silently ignored setting.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The device assignment (spmd.mesh.create_mesh). One -1 fills the rest.
  config.mesh = ml_collections.ConfigDict()
  config.mesh.ici = "data=-1,fsdp=1,tensor=1"  # inside a slice (or the whole job)
  config.mesh.dcn = ""  # across TPU slices / GPU nodes, e.g. "data=2"
  config.mesh.rules = "fsdp"  # logical axis rules preset: dp, fsdp, fsdp_tp
  config.mesh.batch_axes = ("data", "fsdp")  # mesh axes that split the batch

  # Global batch: the same whatever the number of hosts.
  config.global_batch = 32
  return config
