"""TCMalloc for the processes a launcher starts, where this machine has it.

XLA:CPU allocates each step's temporary buffers and frees them at its end.
glibc's malloc returns buffers over 32 MiB straight to the kernel (mmap and
munmap), so every step page-faults its large buffers in again. TCMalloc
keeps freed memory for the next step, so a process pays for its large
buffers once rather than on every step. Preloading TCMalloc is also the
usual advice for JAX on TPU VMs, whose host side sees the same pattern.

Nothing is installed here: Debian and Ubuntu ship it as
`libtcmalloc-minimal4` (the Docker images install it). Without it, or with
`SPMD_TCMALLOC=0`, the environment is left as it is.

Example:
  >>> env = with_tcmalloc({"LD_PRELOAD": "/opt/other.so"}, search_dirs=())
  >>> env["LD_PRELOAD"]  # not found in the (empty) search path: unchanged
  '/opt/other.so'
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
SEARCH_DIRS = (
  "/usr/lib/x86_64-linux-gnu",
  "/usr/lib/aarch64-linux-gnu",
  "/usr/lib64",
  "/usr/lib",
  "/usr/local/lib",
)
OPT_OUT = "SPMD_TCMALLOC"  # "0" leaves LD_PRELOAD alone


def find_tcmalloc(search_dirs: Sequence[str] = SEARCH_DIRS) -> str | None:
  """The path of a TCMalloc shared library in `search_dirs`, or None."""
  for directory in search_dirs:
    for name in NAMES:
      path = os.path.join(directory, name)
      if os.path.isfile(path):
        return path
  return None


def is_preloaded(env: Mapping[str, str] = os.environ) -> bool:
  """True when `env`'s LD_PRELOAD already names a TCMalloc library."""
  return "tcmalloc" in env.get("LD_PRELOAD", "")


def with_tcmalloc(
  env: Mapping[str, str], search_dirs: Sequence[str] = SEARCH_DIRS
) -> dict[str, str]:
  """A copy of `env` whose LD_PRELOAD starts with TCMalloc, if found and not opted out."""
  out = dict(env)
  if out.get(OPT_OUT) == "0" or is_preloaded(out):
    return out
  path = find_tcmalloc(search_dirs)
  if path is None:
    return out
  # LD_PRELOAD takes a space- or colon-separated list; keep what was there.
  out["LD_PRELOAD"] = " ".join(p for p in (path, out.get("LD_PRELOAD", "")) if p)
  return out
