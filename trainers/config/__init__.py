"""The run's config: the defaults (`defaults.py`) and the checks every config passes once, up front (`checks.py`).

`resolve` is what `spmd-train`, `spmd-plan` and the saved-run readers call on a
loaded config.
"""

from trainers.config.checks import check_keys, check_values, resolve

__all__ = ["check_keys", "check_values", "resolve"]
