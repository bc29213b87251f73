"""The code's layers, read from its imports: no circle, and the data path's two rooms apart.

Every `.py` file of the repository is parsed (nothing is imported), and
every import counts: at the top, inside a function, under `TYPE_CHECKING`.
A circle between modules anywhere, or between the folders and files that
sit side by side in one folder of the code (packages), is a failure naming
its members and the imports that close it. `trainers/data/` has two
rooms, `prepare/` (sources to records on disk) and `read/` (records on disk
to step-indexed batches): they meet only in `records/`, the record format,
which imports neither.
"""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Folders that hold no code of the repository's own (a venv, build outputs, runs).
_NOT_CODE = {"build", "dist", "workdir", "node_modules", "__pycache__"}

# The folders whose packages are layered (CONTRIBUTING.md, "Layers"); tests/
# too, whose folders group tests by what they test: what several of them
# use (tests/injection.py, the fault section the test configs add) sits in
# tests/ itself, below them all.
LAYERED = ("spmd", "trainers", "launch", "configs", "benchmarks", "examples", "tests")

DATA = "trainers.data"
DATA_ROOMS = (f"{DATA}.prepare", f"{DATA}.read")
RECORD_FORMAT = f"{DATA}.records"


def _module_files(root: Path) -> dict[str, Path]:
  """Dotted name -> file, for every Python file under `root` outside hidden and build folders."""
  found = {}
  for folder, subfolders, names in os.walk(root):
    # Pruned here, not filtered after: a venv holds far more files than the code.
    subfolders[:] = sorted(
      d for d in subfolders if not (d.startswith(".") or d in _NOT_CODE or d.endswith(".egg-info"))
    )
    parts = Path(folder).relative_to(root).parts
    for name in sorted(n for n in names if n.endswith(".py")):
      dotted = list(parts) + ([] if name == "__init__.py" else [name[:-3]])
      if dotted:
        found[".".join(dotted)] = Path(folder) / name
  return found


def _is_package(name: str, files: dict[str, Path]) -> bool:
  return files[name].name == "__init__.py"


def _statements(tree: ast.Module):
  """Every statement of `tree`, however deeply nested (an import is a statement, never an expression)."""
  stack = list(tree.body)
  while stack:
    node = stack.pop()
    yield node
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
      stack.extend(getattr(node, field, ()))


def _imported(tree: ast.Module, name: str, files: dict[str, Path]) -> set[str]:
  """The repository's modules that module `name` imports, anywhere in its body."""
  package = name if _is_package(name, files) else name.rpartition(".")[0]
  targets: set[str] = set()

  def known(dotted: str) -> str | None:
    while dotted and dotted not in files:  # `import a.b.c` of a name inside a.b
      dotted = dotted.rpartition(".")[0]
    return dotted or None

  for node in _statements(tree):
    if isinstance(node, ast.Import):
      targets.update(filter(None, (known(a.name) for a in node.names)))
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        # `from pkg import module` imports that module; `from pkg import name`, pkg itself.
        target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else known(base)
        if target:
          targets.add(target)
  targets.discard(name)
  return targets


@functools.cache  # read once for the module's tests; they only read it
def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
  """Module -> the repository's modules it imports (a package is its `__init__.py`)."""
  files = _module_files(root)
  graph = {}
  for name, path in files.items():
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    graph[name] = _imported(tree, name, files)
  return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected parts of `graph` with more than one member (Tarjan's algorithm)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found = []

  def visit(node: str) -> None:
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for successor in sorted(graph.get(node, ())):
      if successor not in index:
        visit(successor)
        low[node] = min(low[node], low[successor])
      elif successor in on_stack:
        low[node] = min(low[node], index[successor])
    if low[node] == index[node]:
      part = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        part.append(member)
        if member == node:
          break
      if len(part) > 1:
        found.append(sorted(part))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def _ties(graph: dict[str, set[str]], members: Iterable[str], owner=lambda m: m) -> list[str]:
  """The imports between `members` (as `owner` groups modules), `a -> b` each."""
  members = set(members)
  return sorted(
    {
      f"{source} -> {target}"
      for source, targets in graph.items()
      for target in targets
      if owner(source) in members and owner(target) in members and owner(source) != owner(target)
    }
  )


def package_circles(graph: dict[str, set[str]]) -> dict[str, list[list[str]]]:
  """For each folder, the circles between what sits side by side in it (its files and folders).

  A module belongs to the child of the folder that holds it; a package's
  `__init__.py` is the child `__init__` of its own folder. A circle between
  modules in two folders is also a circle in the folder both sit under.
  """

  def child_of(module: str, folder: str) -> str | None:
    if folder and not module.startswith(folder + "."):
      return "__init__" if module == folder else None
    rest = module[len(folder) + 1 :] if folder else module
    return rest.split(".")[0]

  folders = {""} | {m.rpartition(".")[0] for m in graph} | set(graph)
  found = {}
  for folder in sorted(folders):
    children: dict[str, set[str]] = {}
    for source, targets in graph.items():
      a = child_of(source, folder)
      if a is None:
        continue
      children.setdefault(a, set())
      for target in targets:
        b = child_of(target, folder)
        if b is not None and b != a:
          children[a].add(b)
    parts = circles(children)
    if parts:
      found[folder or "(the repository)"] = parts
  return found


def test_no_module_imports_in_a_circle():
  graph = import_graph()
  found = {" <-> ".join(part): _ties(graph, part) for part in circles(graph)}
  assert not found, f"modules that import each other in a circle (and the imports): {found}"


def test_no_package_imports_in_a_circle():
  graph = import_graph()
  code = {
    m: {t for t in targets if t.split(".")[0] in LAYERED}
    for m, targets in graph.items()
    if m.split(".")[0] in LAYERED
  }
  found = package_circles(code)
  assert not found, f"packages side by side that import each other in a circle: {found}"


def test_the_data_paths_two_rooms_meet_only_in_the_record_format():
  graph = import_graph()
  data = sorted(m for m in graph if m.startswith(DATA + "."))

  def room(module: str) -> str | None:
    rooms = (*DATA_ROOMS, RECORD_FORMAT)
    return next((r for r in rooms if module == r or module.startswith(r + ".")), None)

  homeless = [m for m in data if room(m) is None]
  assert not homeless, (
    f"modules of {DATA} in none of {DATA_ROOMS} nor the record format {RECORD_FORMAT}: {homeless}"
  )
  crossings = _ties(graph, DATA_ROOMS, owner=room)
  assert not crossings, f"the two rooms import each other, not only {RECORD_FORMAT}: {crossings}"
  upward = sorted(
    f"{m} -> {t}"
    for m in data
    if room(m) == RECORD_FORMAT
    for t in graph[m]
    if room(t) in DATA_ROOMS
  )
  assert not upward, f"the record format imports a room above it: {upward}"


def test_the_reader_sees_every_kind_of_import(tmp_path):
  """Imports in a function, under TYPE_CHECKING, relative and of a package's module all count."""
  for relative, text in {
    "a/__init__.py": "",
    "a/one.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from a.two import X\n",
    "a/two.py": "def f():\n  from . import three\n",
    "a/three.py": "import a.one\n",
    "b/__init__.py": "from a import one\n",
    "c.py": "import b\nimport numpy\n",
  }.items():
    (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / relative).write_text(text)
  graph = import_graph(tmp_path)
  assert graph == {
    "a": set(),
    "a.one": {"a.two"},
    "a.two": {"a.three"},
    "a.three": {"a.one"},
    "b": {"a.one"},
    "c": {"b"},
  }
  assert circles(graph) == [["a.one", "a.three", "a.two"]]
  assert package_circles(graph) == {"a": [["one", "three", "two"]]}
  # Two folders that import each other, with no circle between their modules.
  graph = {"p.x": {"q.y"}, "q.z": {"p.w"}, "p.w": set(), "q.y": set()}
  assert circles(graph) == []
  assert package_circles(graph) == {"(the repository)": [["p", "q"]]}
