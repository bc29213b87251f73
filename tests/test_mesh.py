"""Named meshes, the per-host data layout and logical rules, in one process."""

import jax
import numpy as np
import pytest

from spmd import layout, mesh_cli, rules
from spmd.mesh import create_mesh, parse_axes, resolve_sizes

NP = jax.sharding.PartitionSpec


def test_parse_axes_forms_and_errors():
  assert parse_axes("data=-1, tensor=2") == [("data", -1), ("tensor", 2)]
  assert parse_axes({"data": 4, "fsdp": 2}) == [("data", 4), ("fsdp", 2)]
  assert parse_axes([("data", 8)]) == [("data", 8)]
  with pytest.raises(ValueError, match="not of the form name=size"):
    parse_axes("data")
  with pytest.raises(ValueError, match="is not an integer"):
    parse_axes("data=x")
  with pytest.raises(ValueError, match="names repeat"):
    parse_axes([("data", 2), ("data", 2)])


@pytest.mark.parametrize(
  "axes,total,message",
  [
    ([("data", -1), ("tensor", -1)], 8, r"axes \['data', 'tensor'\] are all -1"),
    ([("data", 2), ("tensor", 2)], 8, "multiply to 4, but there are 8 devices"),
    ([("data", -1), ("tensor", 3)], 8, "multiply to 3, which does not divide the 8 devices"),
    ([("data", 0)], 8, "must be positive or -1"),
  ],
)
def test_impossible_sizes_are_named(axes, total, message):
  with pytest.raises(ValueError, match=message):
    resolve_sizes(axes, total)


def test_mesh_keeps_the_users_axis_order_with_auto_axes():
  mesh = create_mesh("tensor=2,data=-1,fsdp=1")
  assert mesh.axis_names == ("tensor", "data", "fsdp")
  assert dict(mesh.shape) == {"tensor": 2, "data": 4, "fsdp": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  # Model axes vary fastest over the device order, whatever the axis order.
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  assert ids[:, 0, 0].tolist() == [0, 1] and ids[0, :, 0].tolist() == [0, 2, 4, 6]


def test_dcn_errors():
  with pytest.raises(ValueError, match=r"DCN axes \['model'\] are not among"):
    create_mesh("data=-1", dcn="model=2")
  with pytest.raises(ValueError, match="multiply to 2, but there are 1 processes"):
    create_mesh("data=-1", dcn="data=2")
  with pytest.raises(ValueError, match="only the axes .* may cross DCN"):
    create_mesh("data=-1,tensor=1", dcn=[("tensor", -1)], devices=_fake_hosts(2, 4))


class _FakeDevice:
  """Enough of a device for the layout math: an id and a process."""

  platform = "cpu"
  device_kind = "fake"

  def __init__(self, i, process):
    self.id, self.process_index = i, process

  def __repr__(self):
    return f"D{self.id}@p{self.process_index}"


def _fake_hosts(hosts, per_host):
  return [_FakeDevice(p * 1000 + i, p) for p in range(hosts) for i in range(per_host)]


def test_dcn_over_processes_puts_data_blocks_per_process():
  mesh = create_mesh("data=-1,tensor=2", dcn="data=-1", devices=_fake_hosts(4, 2))
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  assert dict(mesh.shape) == {"data": 4, "tensor": 2}
  assert procs.tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]


def test_host_major_meshes_keep_model_groups_inside_hosts():
  devices = _fake_hosts(4, 4)
  mesh = create_mesh("data=-1,tensor=2", devices=devices)
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  assert all(len(set(row)) == 1 for row in procs)  # each tensor pair on one host
  wide = create_mesh("data=-1,tensor=8", devices=devices)  # spans two whole hosts
  procs = np.vectorize(lambda d: d.process_index)(wide.devices)
  assert [sorted(set(row)) for row in procs] == [[0, 1], [2, 3]]


def test_data_layout_single_process_and_errors():
  mesh = create_mesh("data=-1,fsdp=2,tensor=2")
  lay = layout.data_layout(mesh, 32)
  assert lay.batch_axes == ("data", "fsdp") and lay.data_parallel == 4
  assert lay.num_shards == 1 and lay.host().rows == range(32) and lay.per_host_batch == 32
  assert sorted(r.start for _, r in lay.host().device_rows) == [0, 0, 8, 8, 16, 16, 24, 24]
  with pytest.raises(
    ValueError,
    match="global_batch=30 is not divisible by the data-parallel "
    r"size 4 \(batch axes \{'data': 2, 'fsdp': 2\}\)",
  ):
    layout.data_layout(mesh, 30)
  with pytest.raises(ValueError, match=r"batch axes \['rows'\] are not mesh axes"):
    layout.data_layout(mesh, 32, ["rows"])


def test_data_layout_across_fake_hosts_feeds_every_row_once_per_replica():
  mesh = create_mesh("data=-1,tensor=8", devices=_fake_hosts(4, 4))  # tensor spans 2 hosts
  lay = layout.data_layout(mesh, 16)
  assert lay.num_shards == 2 and lay.per_host_batch == 8
  assert [h.rows for h in lay.hosts] == [range(0, 8), range(0, 8), range(8, 16), range(8, 16)]
  assert [h.shard for h in lay.hosts] == [0, 0, 1, 1]


def test_non_contiguous_hosts_are_an_error():
  devices = _fake_hosts(2, 2)
  interleaved = jax.sharding.Mesh(
    np.array([devices[0], devices[2], devices[1], devices[3]], dtype=object), ("data",)
  )
  with pytest.raises(ValueError, match="not one contiguous block"):
    layout.data_layout(interleaved, 8)


def test_rules_presets_and_errors():
  mesh = create_mesh("data=-1,fsdp=2,tensor=2")
  assert rules.logical_to_spec(("embed", "mlp"), rules.FSDP_TP, mesh) == NP("fsdp", "tensor")
  assert rules.logical_to_spec(("embed", "mlp"), rules.FSDP, mesh) == NP("fsdp")
  assert rules.logical_to_spec(("embed", "mlp"), rules.DATA_PARALLEL, mesh) == NP()
  assert rules.logical_to_spec(("batch", "embed"), rules.FSDP, mesh) == NP(("data", "fsdp"))
  no_fsdp = create_mesh("data=-1")
  assert rules.logical_to_spec(("batch", "embed"), rules.FSDP, no_fsdp) == NP("data")
  with pytest.raises(ValueError, match="logical axis 'embd' has no rule"):
    rules.logical_to_spec(("embd",), rules.FSDP)
  with pytest.raises(ValueError, match="unknown rules preset 'zero3'"):
    rules.preset("zero3")
  assert rules.preset("fsdp_tp") is rules.FSDP_TP


def test_logical_to_sharding_checks_divisibility_with_paths():
  mesh = create_mesh("data=-1,fsdp=2,tensor=2")
  logical = {"dense": {"kernel": ("embed", "mlp"), "bias": ("mlp",)}}
  shapes = {
    "dense": {
      "kernel": jax.ShapeDtypeStruct((8, 6), np.float32),
      "bias": jax.ShapeDtypeStruct((6,), np.float32),
    }
  }
  shardings = rules.logical_to_sharding(logical, mesh, rules.FSDP_TP, shapes)
  assert shardings["dense"]["kernel"].spec == NP("fsdp", "tensor")
  bad = {
    "dense": {
      "kernel": jax.ShapeDtypeStruct((8, 5), np.float32),
      "bias": jax.ShapeDtypeStruct((6,), np.float32),
    }
  }
  with pytest.raises(
    ValueError,
    match=r"\['dense'\]\['kernel'\]: dimension 1 of shape=\(8, 5\) "
    "is not divisible by 2",
  ):
    rules.logical_to_sharding(logical, mesh, rules.FSDP_TP, bad)


def test_spmd_mesh_cli_local(capsys):
  assert mesh_cli.main(["--mesh=data=-1,tensor=2", "--global_batch=16"]) == 0
  out = capsys.readouterr().out
  assert "axes: data=4  tensor=2" in out and "0..15" in out
  assert mesh_cli.main(["--mesh=data=3"]) == 2
  assert "multiply to 3, but there are 8 devices" in capsys.readouterr().err


def test_spmd_mesh_cli_reads_a_config_and_its_overrides(capsys):
  argv = [
    "--config=configs/default.py",
    "--config.mesh.ici=data=-1,fsdp=2,tensor=2",
    "--config.global_batch=64",
  ]
  assert mesh_cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "axes: data=2  fsdp=2  tensor=2" in out
  assert "global batch 64 split over ('data', 'fsdp')" in out
  # A misspelt key is a user error: one line naming it and the nearest key, exit 2.
  assert mesh_cli.main(["--config=configs/default.py", "--config.mesh.icii=data=-1"]) == 2
  err = capsys.readouterr().err
  assert "config.mesh has no setting 'icii' (did you mean 'ici'?)" in err, err


@pytest.mark.parametrize("module", ["spmd.mesh_cli", "trainers.planning.plan_cli"])
def test_help_prints_the_usage_and_the_flags_and_exits_0(module, capsys):
  import importlib

  cli = importlib.import_module(module)
  assert cli.main(["--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith(cli.__doc__.strip().splitlines()[0])
  assert "--topology" in out and "--config" in out


def test_a_batch_axis_the_mesh_lacks_is_an_error_naming_it_and_the_axes():
  """A misspelt batch axis was dropped, so the batch went unsplit along fsdp without a word."""
  from configs import mlp
  from trainers.config.checks import resolve

  config = mlp.get_config()
  config.mesh.ici = "data=2,fsdp=4"
  config.mesh.batch_axes = ("data", "fsdb")
  with pytest.raises(ValueError) as e:
    resolve(config)
  assert str(e.value) == (
    "config.mesh.batch_axes=('data', 'fsdb'): 'fsdb' is not a mesh axis of the trainer; "
    "its axes: data, fsdp, expert, context, tensor"
  )


def test_context_is_a_mesh_axis_of_every_preset_for_the_length_and_the_fsdp_weights():
  """`length` maps to `context` in every preset, and the FSDP presets' `embed` after `fsdp`.

  The batch never takes it, an activation's `embed` never does (`length` has
  it first), and decoding's rules give it to nothing. A preset that maps it is
  a no-op on a mesh without the axis (rules skip absent axes)."""
  for name, preset in rules.PRESETS.items():
    table = dict(preset)
    assert table["length"] == "context", name
    others = {k for k, v in table.items() if "context" in ((v,) if isinstance(v, str) else v or ())}
    assert others == ({"length"} if name == "dp" else {"length", "embed"}), (name, others)
    whole = create_mesh("data=-1,tensor=2")
    assert rules.logical_to_spec(("batch", "length", "embed"), preset, whole)[1:2] in ((), (None,))
  mesh = create_mesh("data=2,context=4")
  assert mesh.shape == {"data": 2, "context": 4}
  spec = rules.logical_to_spec((("batch", "length"), "embed"), rules.FSDP_TP, mesh)
  assert spec == rules.NamedSpec(("data", "context"))
  activation = rules.logical_to_spec(("batch", "length", "embed"), rules.FSDP, mesh)
  assert activation == rules.NamedSpec("data", "context")
  assert rules.logical_to_spec(("embed", "mlp"), rules.FSDP, mesh) == rules.NamedSpec("context")
  decoding = rules.whole_sequence(rules.FSDP)
  assert rules.logical_to_spec(("batch", "length", "embed"), decoding, mesh) == rules.NamedSpec(
    "data"
  )


def test_context_may_cross_dcn_and_the_config_accepts_it_but_not_as_a_batch_axis():
  from configs import llama_tiny
  from trainers.config.checks import resolve
  from trainers.step.mesh import build_mesh

  mesh = create_mesh("data=-1,context=2", dcn="context=2", devices=_fake_hosts(2, 4))
  assert dict(mesh.shape) == {"data": 2, "context": 4}
  # Along context the first half of the devices is one host's, the second the other's.
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  assert procs[0].tolist() == [0, 0, 1, 1]
  config = llama_tiny.get_config()
  config.mesh.ici, config.mesh.rules = "data=2,context=4", "fsdp_tp"
  resolve(config)
  built, axes = build_mesh(config)
  assert dict(built.shape) == {"data": 2, "context": 4} and axes == ("data",)
  config.mesh.ici = "data=2,contxt=4"
  with pytest.raises(ValueError, match="'contxt' is not a mesh axis of the trainer"):
    resolve(config)
  config.mesh.ici, config.mesh.batch_axes = "data=2,context=4", ("data", "context")
  with pytest.raises(ValueError, match="'context' splits every sequence, not the rows"):
    resolve(config)


def test_expert_splits_the_experts_in_every_preset_carries_the_batch_and_may_cross_dcn():
  """`experts` maps to `expert` in every preset, and `batch` takes it after data and fsdp,
  so outside the routed layers its devices split the rows (none idle). A data axis: it
  may cross DCN, each host holding one block of it, and the config's batch axes hold it."""
  from configs import llama_tiny
  from trainers.config.checks import resolve
  from trainers.step.mesh import build_mesh

  for name, preset in rules.PRESETS.items():
    table = dict(preset)
    assert table["experts"] == "expert" and table["batch"] == ("data", "fsdp", "expert"), name
  mesh = create_mesh("data=2,expert=2", devices=jax.devices()[:4])
  experts = rules.logical_to_spec(("experts", "embed", "mlp"), rules.FSDP_TP, mesh)
  assert experts == rules.NamedSpec("expert")
  activation = rules.logical_to_spec(("batch", "length", "embed"), rules.FSDP, mesh)
  assert activation == rules.NamedSpec(("data", "expert"))
  across = create_mesh("data=1,expert=2", dcn="expert=2", devices=_fake_hosts(2, 2))
  assert dict(across.shape) == {"data": 1, "expert": 4}
  procs = np.vectorize(lambda d: d.process_index)(across.devices)
  assert procs.tolist() == [[0, 0, 1, 1]]
  config = llama_tiny.get_config()
  config.mesh.ici = "data=2,expert=2"
  resolve(config)
  built, axes = build_mesh(config, jax.devices()[:4])
  assert dict(built.shape) == {"data": 2, "expert": 2} and axes == ("data", "expert")
