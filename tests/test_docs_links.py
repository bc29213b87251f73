"""The README and the guides under docs/: every relative link resolves, and none points into the log.

A link to a Markdown file's `#anchor` must name one of its headings, as
GitHub spells them. The engineering log is dated and append-only, so its
old links are left as they were written; the README and the guides never
quote it.
"""

import re
from pathlib import Path

import pytest

from tests.multiprocess import ROOT

LOG = Path(ROOT) / "docs" / "engineering-log.md"
PAGES = [Path(ROOT) / "README.md", *sorted((Path(ROOT) / "docs").glob("*.md"))]
GUIDES = [p for p in PAGES if p != LOG]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def links(text: str) -> list[str]:
  """The targets of a Markdown text's inline links, outside fenced code.

  Example:
    >>> links("see [a](docs/a.md#x) and [b](https://b)\\n```\\n[c](c.md)\\n```\\n")
    ['docs/a.md#x', 'https://b']
  """
  return _LINK.findall(_FENCE.sub("", text))


def anchor(heading: str) -> str:
  """The anchor GitHub gives a heading.

  Example:
    >>> anchor("Cloud storage: `gs://` workdirs and data")
    'cloud-storage-gs-workdirs-and-data'
  """
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
  text = _FENCE.sub("", page.read_text())
  return {anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
  broken = []
  for target in links(page.read_text()):
    if re.match(r"[a-z]+:", target):  # https:, mailto:
      continue
    path, _, fragment = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.exists():
      broken.append(f"{target} (no {resolved})")
    elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
      broken.append(f"{target} (no heading #{fragment} in {resolved.name})")
  assert not broken, f"{page.name}: broken links: {broken}"


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.name)
def test_guides_do_not_point_into_the_log(page):
  text = page.read_text()
  assert "engineering-log" not in text and "NOTES.md" not in text, page.name


def test_every_guide_is_one_link_from_the_readme():
  readme = Path(ROOT) / "README.md"
  linked = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme.read_text())}
  assert {p.resolve() for p in GUIDES if p != readme} <= linked
