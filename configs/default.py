"""The default experiment config; other configs import it and change a few fields.

  spmd-train --config=configs/default.py --workdir=/tmp/run [--config.train.steps=100]

The settings, each with its default and what it does, are in
`trainers/config/defaults.py`: the trainer checks every config against them, so
an unknown key or a value of the wrong type is an error, not a silently ignored
setting.
"""

from trainers.config.defaults import get_config

__all__ = ["get_config"]
