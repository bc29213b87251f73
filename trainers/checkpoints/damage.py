"""A checkpoint that cannot be restored, told apart from storage or machine trouble.

Damage (a truncated or corrupt file, a step of another model) is a
`CheckpointError`: the same checkpoint fails the same way again, so it is a
user error with advice. Trouble (permission, network, I/O, memory) is raised
as what it is: the checkpoint itself may be fine.
"""

from __future__ import annotations

import errno

from spmd.errors import UserError


class CheckpointError(UserError):
  """A checkpoint that cannot be restored: incomplete, damaged, or of another model.

  A user error (`spmd.errors`, a `ValueError`): the same checkpoint fails the
  same way again, so a command says so in one line and launchers do not
  restart; the message names the step and what to do.
  """


# Status names (gRPC's, which tensorstore and XLA use in their messages) and
# phrases that mean the storage or the machine failed, not the checkpoint.
_TROUBLE_MARKERS = (
  "PERMISSION_DENIED",
  "UNAUTHENTICATED",
  "UNAVAILABLE",
  "DEADLINE_EXCEEDED",
  "RESOURCE_EXHAUSTED",
  "ABORTED",
  "Permission denied",
  "Connection refused",
  "Connection reset",
  "timed out",
  "Out of memory",
  "out of memory",
  "No space left",
)
# OS errors that say nothing about the files' contents.
_TROUBLE_ERRNOS = {
  errno.EACCES,
  errno.EPERM,
  errno.EIO,
  errno.ENOMEM,
  errno.ENOSPC,
  errno.ETIMEDOUT,
  errno.ECONNREFUSED,
  errno.ECONNRESET,
  errno.EHOSTUNREACH,
  errno.ENETUNREACH,
}


def is_trouble(error: BaseException) -> bool:
  """Whether `error` (or an error it was raised from) is storage or machine trouble.

  Example:
    >>> is_trouble(PermissionError(13, "Permission denied"))
    True
    >>> is_trouble(ValueError("Error reading: UNAVAILABLE: connection to storage lost"))
    True
    >>> is_trouble(ValueError("Error decoding chunk: unexpected end of data"))
    False
  """
  seen: set[int] = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, MemoryError | PermissionError | ConnectionError | TimeoutError):
      return True
    if isinstance(error, OSError) and error.errno in _TROUBLE_ERRNOS:
      return True
    text = str(error)
    if any(marker in text for marker in _TROUBLE_MARKERS):
      return True
    error = error.__cause__ or error.__context__
  return False


def damaged(what: str, e: Exception) -> CheckpointError:
  detail = " ".join(str(e).split())
  if len(detail) > 400:
    detail = detail[:400] + " ..."
  return CheckpointError(
    f"{what} cannot be restored: it is damaged or incomplete ({type(e).__name__}: {detail}). "
    "Nothing was restored; move that step directory away to resume from an earlier one."
  )
