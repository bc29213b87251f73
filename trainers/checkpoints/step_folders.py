"""The step folders of a checkpoint directory: which are checkpoints, which are the harness's to remove, which are not its own.

A run's checkpoint directory (`<workdir>/checkpoints`) holds orbax step
folders named by their step (`200/`), and, on a local disk, orbax's
temporary folders while a save is written (`200.orbax-checkpoint-tmp...`,
renamed to `200/` once complete; on an object store such as GCS there is no
atomic rename, so orbax writes `200/` in place and its commit marker last).
Any other tool may have left folders there too. `list_steps` reads the
directory and judges each step-like entry (a name of digits, with or
without orbax's temporary suffix):

  * committed: a final name holding orbax's commit marker
    (`commit_success.txt`, written last) and either recorded in the ledger
    or holding the harness's two items (`state/`, `data/`: a checkpoint of
    an earlier version, from before the ledger). It is a checkpoint: resumed
    from, read by eval, export and sampling, rotated by `checkpoint.keep`.
  * unfinished (the harness's own): no commit marker, or a temporary name,
    and its step recorded in the ledger. A save of this harness that was cut
    short (a kill, a preemption, a lost host): never restored, removed when
    the run starts again, and saved again.
  * foreign: everything else step-like. Never restored and never deleted.

The ledger, `spmd_saves.json` in the checkpoint directory, is how the harness
knows a folder is its own: before each save process 0 records the step it is
about to save (`record_save`), before orbax creates anything for it (orbax
creates the step folder on process 0 after that, behind its own barrier).
Written whole in one go (an object store's single upload; a local rename),
it never holds half a list. A marker file inside the step folder would not
do: orbax creates that folder (a temporary name it renames, or the final
one) and owns what is in it, so a marker written before the save has no
folder to go into, and one written after it proves nothing about a folder
left by a kill before it.

One decision, shared by every host (`decide`): process 0 lists and judges
the directory, removes the unfinished steps that are its own, rewrites the
ledger, and shares that one answer with every process through the
coordination service (`spmd.multihost.from_process_0`); the others wait for
it and list nothing. So hosts cannot disagree about which steps exist (each
listing a store at another moment), and nothing is deleted twice. orbax's
own clean-up of temporary folders is switched off (`manager.make_manager`
passes `cleanup_tmp_directories=False`): it runs asynchronously on process 0
alone, with nothing the other hosts can wait on, so it raced this decision;
and on an object store it counts every folder without a commit marker as
its own temporary one, foreign folders included. Running ours after it
would still leave that deletion in place.

orbax's `max_to_keep` clean-up sees only committed steps: the manager is
given `JudgedNameFormat`, which answers orbax's directory listing with the
committed steps of the decision instead of orbax's own (which, on a local
disk, takes any folder named by digits for a finished checkpoint: a foreign
`1/` would have been rotated away). Steps saved since are orbax's to track
as always, so `keep` rotates the run's own checkpoints and nothing else.

A foreign folder is kept and named in a warning, and the run goes on: it
reads and writes other steps. It becomes an error only where the run would
write into it: a foreign step after the one the run resumes from that the
save schedule reaches (raised at start, before any training) or that an
off-schedule save reaches (a preemption's or the last step's, raised by that
save). The error names the folder and says what to do (move it out of the
checkpoint directory, or use another workdir); nothing is deleted.

Example:
  >>> import tempfile
  >>> from etils import epath
  >>> root = epath.Path(tempfile.mkdtemp())
  >>> _ = (root / "1").mkdir(), (root / "1" / "foreign.bin").write_text("x")
  >>> record_save(root, 2)  # the harness is about to save step 2 ...
  >>> (root / "2").mkdir()  # ... and is killed before orbax commits it
  >>> steps = list_steps(root)
  >>> steps.committed, steps.unfinished, steps.foreign
  ((), ('2',), ('1',))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from spmd import multihost
from spmd.errors import UserError
from trainers import paths

log = logging.getLogger(__name__)

COMMIT_MARKER = "commit_success.txt"  # orbax writes it last (before the rename, on a local disk)
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's temporary step folders: `<step>` + this (+ more)
LEDGER = "spmd_saves.json"  # the steps this harness started saving here
ITEMS = ("state", "data")  # what the harness saves in each step
# A local disk or an object store may take a while to delete a large
# unfinished step: the other hosts wait this long for process 0's decision.
DECISION_TIMEOUT_S = 600.0

_STEP_NAME = re.compile(r"^(0|[1-9][0-9]*)(" + re.escape(TMP_SUFFIX) + r".*)?$")


class ForeignStepError(UserError):
  """The run would write into a step folder the harness did not write."""


def step_of(name: str) -> int | None:
  """The step a folder name stands for (final or orbax-temporary), or None if it is not step-like.

  Example:
    >>> step_of("200"), step_of("200.orbax-checkpoint-tmp-17"), step_of("007"), step_of("x")
    (200, 200, None, None)
  """
  found = _STEP_NAME.match(name)
  return int(found.group(1)) if found else None


@dataclasses.dataclass(frozen=True)
class StepDirs:
  """One judgment of a checkpoint directory (see the module docstring).

  `committed` holds steps, in order; `unfinished` and `foreign` hold folder
  names (a step may have a final and a temporary one).
  """

  directory: str
  committed: tuple[int, ...] = ()
  unfinished: tuple[str, ...] = ()
  foreign: tuple[str, ...] = ()

  @property
  def latest(self) -> int | None:
    """The newest committed step, or None."""
    return self.committed[-1] if self.committed else None

  def foreign_at(self, step: int) -> list[str]:
    """The foreign folders a save of `step` would write into."""
    return [name for name in self.foreign if step_of(name) == step]

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, record: dict[str, Any]) -> StepDirs:
    return cls(
      record["directory"],
      tuple(record["committed"]),
      tuple(record["unfinished"]),
      tuple(record["foreign"]),
    )


def read_ledger(directory: str | os.PathLike) -> set[int]:
  """The steps the ledger says the harness started saving in `directory` (empty if none).

  A ledger that cannot be read counts as empty: then no folder is taken for
  the harness's own, so nothing is deleted (the safe side).
  """
  path = epath.Path(directory) / LEDGER
  if not path.exists():
    return set()
  try:
    return {int(s) for s in json.loads(path.read_text())["steps"]}
  except (ValueError, KeyError, TypeError) as e:
    log.warning("%s cannot be read (%s): no step folder there is taken for this run's", path, e)
    return set()


def _write_ledger(directory: epath.Path, steps: Iterable[int]) -> None:
  text = json.dumps({"written_by": "spmd-harness", "steps": sorted(set(steps))}) + "\n"
  path = directory / LEDGER
  if paths.is_url(directory):
    path.write_text(text)  # one object upload: whole or absent
    return
  tmp = directory / f".{LEDGER}.{os.getpid()}.tmp"
  tmp.write_text(text)
  os.replace(tmp, path)  # whole or absent, never half a list


def _entries(directory: epath.Path) -> list[epath.Path]:
  if not directory.is_dir():
    return []
  return sorted(
    (p for p in directory.iterdir() if step_of(p.name) is not None),
    key=lambda p: (step_of(p.name), p.name),
  )


def list_steps(directory: str | os.PathLike) -> StepDirs:
  """Reads `directory` and judges its step folders; changes nothing. One process's view."""
  directory = epath.Path(directory)
  ledger = read_ledger(directory)
  committed, unfinished, foreign = [], [], []
  for path in _entries(directory):
    step, name = step_of(path.name), path.name
    final = name == str(step)
    if final and (path / COMMIT_MARKER).exists():
      ours = step in ledger or all((path / item).is_dir() for item in ITEMS)
      (committed if ours else foreign).append(step if ours else name)
    elif step in ledger:
      unfinished.append(name)
    else:
      foreign.append(name)
  return StepDirs(str(directory), tuple(committed), tuple(unfinished), tuple(foreign))


def is_committed(directory: str | os.PathLike, step: int) -> bool:
  """Whether `directory` holds step `step` with orbax's commit marker."""
  return (epath.Path(directory) / str(step) / COMMIT_MARKER).exists()


def _remove(path: epath.Path) -> None:
  if path.is_dir():
    path.rmtree(missing_ok=True)
  elif path.exists():
    path.unlink(missing_ok=True)


def settle(directory: str | os.PathLike) -> StepDirs:
  """Judges `directory`, removes the harness's own unfinished steps, rewrites the ledger.

  Process 0's half of `decide`; returns the judgment, with `unfinished`
  naming what was removed.
  """
  directory = epath.Path(directory)
  steps = list_steps(directory)
  for name in steps.unfinished:
    _remove(directory / name)
  if steps.unfinished or (directory / LEDGER).exists():
    _write_ledger(directory, steps.committed)  # what is left of this run's steps
  return steps


def decide(directory: str | os.PathLike) -> StepDirs:
  """The one judgment of `directory` every process acts on; process 0 makes it.

  Process 0 lists the directory, removes the harness's unfinished steps and
  names what it removed and what it keeps that is not its own; every
  process returns that same judgment (the others wait for it). Every
  process must call this, in the same order as the other calls of it.
  """
  directory = epath.Path(directory)
  steps = StepDirs.from_json(
    multihost.from_process_0(
      "checkpoint steps", lambda: settle(directory).to_json(), DECISION_TIMEOUT_S
    )
  )
  if jax.process_index() == 0:
    if steps.unfinished:
      log.warning(
        "checkpoint steps %s in %s were never finished (no %s): removed, never restored; "
        "the run saves them again",
        sorted({step_of(n) for n in steps.unfinished}),
        directory,
        COMMIT_MARKER,
      )
    if steps.foreign:
      log.warning(
        "folders %s in %s look like checkpoint steps but this run did not write them (not in "
        "%s): kept as they are, never restored or deleted",
        list(steps.foreign),
        directory,
        LEDGER,
      )
  return steps


def record_save(directory: str | os.PathLike, step: int, saving: Iterable[int] = ()) -> None:
  """Process 0 records in the ledger that the harness is about to save `step`.

  Called before the save creates anything. The ledger keeps the steps it
  holds that are still present in the directory, `step`, and `saving` (the
  steps the checkpoint manager tracks, those whose saves are in flight
  included, present or not), so it does not grow with the run's length. On
  an object store a step in flight is listed only once its first file has
  landed: judged by the listing alone, it would drop out here, and a kill
  before its commit would leave a folder the next start takes for foreign.
  """
  if jax.process_index() != 0:
    return
  directory = epath.Path(directory)
  present = {step_of(p.name) for p in _entries(directory)}
  keep = (read_ledger(directory) & present) | set(saving)
  _write_ledger(directory, keep | {step})


def foreign_error(steps: StepDirs, step: int, why: str) -> ForeignStepError:
  """The error for a save of `step` into a foreign folder of `steps`; `why` says which save."""
  names = steps.foreign_at(step)
  shown = ", ".join(str(epath.Path(steps.directory) / n) for n in names)
  return ForeignStepError(
    f"{shown} is not this run's (a step folder it did not write: not in {LEDGER}), and {why} "
    f"would write checkpoint step {step} there. Nothing was deleted. Move it out of "
    f"{steps.directory}, or use another --workdir."
  )


def check_schedule(steps: StepDirs, every: int) -> None:
  """Raises `ForeignStepError` if the save schedule (every `every` steps) reaches a foreign folder.

  Only steps after the one the run resumes from are ever saved.

  Example:
    >>> check_schedule(StepDirs("/ckpt", committed=(2,), foreign=("1", "3")), every=2)
    >>> check_schedule(StepDirs("/ckpt", committed=(2,), foreign=("4",)), every=2)
    Traceback (most recent call last):
    ...
    trainers.checkpoints.step_folders.ForeignStepError: /ckpt/4 is not this run's (a step folder it did not write: not in spmd_saves.json), and the save every 2 steps would write checkpoint step 4 there. Nothing was deleted. Move it out of /ckpt, or use another --workdir.
  """
  start = -1 if steps.latest is None else steps.latest
  for step in sorted({step_of(n) for n in steps.foreign}):
    if step > start and step % max(every, 1) == 0:
      raise foreign_error(steps, step, f"the save every {every} steps")


@dataclasses.dataclass(frozen=True)
class JudgedNameFormat:
  """orbax's step `NameFormat`, listing only the committed steps of one judgment.

  orbax lists the directory itself when its manager starts (and on
  `reload`); this answers with the decision every host shares, so orbax
  never counts a foreign or unfinished folder as a checkpoint (nor rotates
  it away with `max_to_keep`). Naming and finding one step are orbax's own.
  The steps saved after the decision orbax tracks itself, as always; its
  `reload` would forget them (it asks this again), and nothing here calls it.
  """

  committed: tuple[int, ...]
  standard: Any = dataclasses.field(default_factory=ocp.step.standard_name_format)

  def build_name(self, step: int) -> str:
    return self.standard.build_name(step)

  def find_all(self, base_path: epath.PathLike) -> Iterator[ocp.step.Metadata]:
    base = epath.Path(base_path)
    return iter([ocp.step.Metadata(step=s, path=base / self.build_name(s)) for s in self.committed])

  def find_step(self, base_path: epath.PathLike, step: int) -> ocp.step.Metadata:
    return self.standard.find_step(base_path, step)
