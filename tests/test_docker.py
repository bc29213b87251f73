"""The Dockerfiles: pinned bases, installed from this repo's setup.py, non-root, spmd-train.

Docker cannot run on the machines this project is built and tested on, so the
images are checked by reading them; the build commands are in the README.
"""

import re

import pytest

from tests.multiprocess import ROOT

EXTRAS = {"cpu": "test", "gpu": "cuda", "tpu": "tpu"}


def setup_extras():
  text = (ROOT / "setup.py").read_text()
  block = text[text.index("extras_require") :]
  return set(re.findall(r'"(\w+)": \[', block))


@pytest.mark.parametrize("kind", sorted(EXTRAS))
def test_dockerfile(kind):
  lines = [
    line.strip()
    for line in (ROOT / "docker" / kind / "Dockerfile").read_text().splitlines()
    if line.strip() and not line.strip().startswith("#")
  ]
  bases = [line.split()[1] for line in lines if line.startswith("FROM ")]
  assert bases, "no FROM line"
  for base in bases:  # a full version tag or a digest, never a floating tag
    assert "@sha256:" in base or re.search(r":\d+\.\d+\.\d+", base), base
    assert not base.endswith(":latest")
  installs = [line for line in lines if "pip install" in line]
  assert installs == [f"RUN python -m pip install --no-cache-dir '.[{EXTRAS[kind]}]'"]
  assert EXTRAS[kind] in setup_extras()
  assert not any("requirements" in line for line in lines)  # one dependency list: setup.py
  users = [line.split()[1] for line in lines if line.startswith("USER ")]
  assert users and users[-1] not in ("root", "0")
  assert any(line.startswith("ENTRYPOINT") and "spmd-train" in line for line in lines)


@pytest.mark.parametrize("kind", sorted(EXTRAS))
def test_images_preload_the_tcmalloc_they_install(kind):
  text = (ROOT / "docker" / kind / "Dockerfile").read_text()
  assert "libtcmalloc-minimal4" in text
  [link] = re.findall(r"ln -s .* (/\S+libtcmalloc_minimal\.so\.4)", text)
  assert f"ENV LD_PRELOAD={link} " in text
