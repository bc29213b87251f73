"""The `debug` section (trainers/debug.py): only configs that add it may set its keys,
checked up front like any other section; the defaults carry no fault switch."""

import ml_collections
import pytest

from configs import default
from tests.configs import train_tiny
from trainers import debug
from trainers.config import checks as config_lib


def test_the_default_config_has_no_fault_injection():
  config = default.get_config()
  assert "debug" not in config
  flat = config_lib._flat(config)
  assert not [k for k in flat if "inject" in k or "param_hash" in k], flat


def test_debug_keys_are_not_settings_against_the_defaults():
  config = default.get_config()
  config.debug = debug.section()  # resolve() takes it only as the config file's own section
  with pytest.raises(ValueError, match=r"config\.debug\.inject_\w+ is not a setting"):
    config_lib.check_keys(config, config_lib.defaults.get_config())


def test_the_section_is_checked_by_name_type_and_value():
  config = train_tiny.get_config()
  config.debug.inject_stal = (1, 6)
  with pytest.raises(
    ValueError, match=r"config\.debug\.inject_stal is not a setting.*inject_stall"
  ):
    config_lib.resolve(config)
  config = train_tiny.get_config()
  config.debug = ml_collections.ConfigDict({"report_param_hash": "yes"})  # a file's own section
  with pytest.raises(ValueError, match=r"config\.debug\.report_param_hash='yes' is a str"):
    config_lib.resolve(config)
  for key, value, message in [
    ("inject_nonfinite_value", "zero", "inject_nonfinite_value='zero' must be one of"),
    ("inject_bad_batch", (1, 3, "size"), "kind 'size' is not one of"),
    ("inject_stall", (1,), r"inject_stall=\(1,\) must be \(\) or \(process, step\)"),
  ]:
    config = train_tiny.get_config()
    config.debug[key] = value
    with pytest.raises(ValueError, match=message):
      config_lib.check_values(config)
  resolved = config_lib.resolve(train_tiny.get_config())
  assert resolved.debug.to_dict() == dict(debug.section().to_dict(), report_param_hash=True)
