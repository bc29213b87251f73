"""Fault injection lives in the tests (tests/injection.py), reached through the public
`Wrapper` and `Hook` API: the product carries no fault switch, and the test section's keys are
checked up front like any other, by the factory that owns them."""

import re
from pathlib import Path

import ml_collections
import pytest

from configs import default
from tests import injection
from tests.configs import train_tiny
from tests.multiprocess import ROOT
from trainers.config import resolve


def test_the_product_has_no_fault_injection():
  assert "faults" not in default.get_config().hook_settings
  assert not default.get_config().hooks
  # Nothing under trainers/ names an injection key (read in-process: the fast
  # tier starts no process, not even git).
  pattern = re.compile(r"inject_|report_param_hash|param_hash")
  sources = sorted((Path(ROOT) / "trainers").rglob("*.py"))
  assert len(sources) > 50
  assert [str(p) for p in sources if pattern.search(p.read_text())] == []


def test_the_section_is_checked_by_name_type_and_value_when_the_config_is_resolved():
  config = train_tiny.get_config()
  config.hook_settings.faults.inject_stal = (1, 6)
  with pytest.raises(ValueError, match=r"faults\.inject_stal is not a setting.*inject_stall"):
    resolve(config)
  config = train_tiny.get_config()
  # A config file's own section (an override is type-checked by ml_collections already).
  config.hook_settings.faults = ml_collections.ConfigDict({"report_param_hash": "yes"})
  with pytest.raises(ValueError, match=r"faults\.report_param_hash='yes' is a str"):
    resolve(config)
  for key, value, message in (
    ("inject_nonfinite_value", "zero", "inject_nonfinite_value='zero' must be one of"),
    ("inject_bad_batch", (1, 3, "size"), "kind 'size' is not one of"),
    ("inject_stall", (1,), r"inject_stall=\(1,\) must be \(\) or \(process, step\)"),
  ):
    config = train_tiny.get_config()
    config.hook_settings.faults[key] = value
    with pytest.raises(ValueError, match=message):
      resolve(config)


def test_hook_settings_are_the_factories_own_and_kept_whole():
  config = default.get_config()
  config.hooks = (injection.HOOK_SPEC,)
  # A partial section: what it leaves out is off.
  config.hook_settings.faults = ml_collections.ConfigDict({"report_param_hash": True})
  config.hook_settings.mine = ml_collections.ConfigDict({"anything": [1, 2]})  # nobody checks it
  resolved = resolve(config)
  assert resolved.hook_settings.to_dict() == {
    "faults": {"report_param_hash": True},
    "mine": {"anything": [1, 2]},
  }
  hooks = injection.faults(resolved)
  assert [type(h).__name__ for h in hooks] == ["Wrapper", "Hook"]
  wrapper = hooks[0]
  assert wrapper.host_rows is None and wrapper.batches is None and wrapper.train_step is None
