"""Python's cyclic garbage collector, paused while a command imports its libraries.

Importing JAX, Flax, orbax and TFDS leaves the collector hundreds of
thousands of objects to track, and they live as long as the process. Its
full passes, several during the imports and more after them, walk every one
of them each time. A command
pauses the collector at its start (`pause_collection`) and, once its
imports are done, moves what they made into the permanent generation and
starts collecting again (`freeze_and_resume`): later passes walk what the
run allocates, not the libraries. What is frozen is never freed, as the
modules themselves never are; garbage the imports left (a few cycles) stays
too. The same advice Python's `gc.freeze` documents, for the same reason.

Example:
  >>> pause_collection()
  >>> gc.isenabled()
  False
  >>> import json  # a command's imports
  >>> freeze_and_resume()
  >>> gc.isenabled(), gc.get_freeze_count() > 0
  (True, True)
"""

from __future__ import annotations

import gc

_paused = False  # by `pause_collection`, so `freeze_and_resume` never enables what it did not pause


def pause_collection() -> None:
  """Stops automatic collection until `freeze_and_resume`; call first thing in a command."""
  global _paused
  if gc.isenabled():
    gc.disable()
    _paused = True


def freeze_and_resume() -> None:
  """Freezes every object alive now (the imports' modules, classes and tables), then collects as before."""
  global _paused
  gc.freeze()
  if _paused:
    gc.enable()
    _paused = False
