"""`spmd-mesh`: print the mesh for a target — axes, hosts, devices, batch rows.

  spmd-mesh --mesh=data=-1,tensor=4 --topology=v5p-64 --global_batch=256
  spmd-mesh --mesh=data=-1 --dcn=data=2 --topology=v5e-256 --num_slices=2
  spmd-mesh --config=configs/default.py --config.mesh.ici=data=-1,tensor=2
  spmd-mesh --mesh=data=-1,tensor=2 --cpu_devices=8          # this machine

It builds the mesh with the same `spmd.mesh.create_mesh` and the layout with
the same `spmd.layout.data_layout` the trainer uses, against this machine's
devices or a TPU slice's real device descriptions (needs the `tpu` extra).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from spmd import errors
from spmd.cli_help import parse_or_help
from spmd.errors import UserError, user_input
from spmd.layout import data_layout
from spmd.mesh import create_mesh
from spmd.topology import topology_devices


def _ranges(values: list[int]) -> str:
  values = sorted(set(values))
  if len(values) == 1:
    return str(values[0])
  if values == list(range(values[0], values[-1] + 1)):
    return f"{values[0]}..{values[-1]}"
  return ",".join(map(str, values))


def describe(mesh, layout=None) -> dict[str, Any]:
  """The mesh and layout as plain data (what `--json` prints)."""
  devices = list(mesh.devices.flat)
  hosts: dict[int, list] = {}
  for d in devices:
    hosts.setdefault(d.process_index, []).append(d)
  slices = sorted({getattr(d, "slice_index", 0) or 0 for d in devices})
  out: dict[str, Any] = {
    "device_kind": devices[0].device_kind,
    "num_devices": len(devices),
    "num_hosts": len(hosts),
    "num_slices": len(slices),
    "axes": dict(mesh.shape),
    "hosts": [],
  }
  if layout is not None:
    out["global_batch"] = layout.global_batch
    out["batch_axes"] = list(layout.batch_axes)
    out["data_parallel"] = layout.data_parallel
    out["distinct_row_blocks"] = layout.num_shards
  for p in sorted(hosts):
    entry: dict[str, Any] = {"process": p, "devices": []}
    positions = {name: [] for name in mesh.axis_names}
    for d in sorted(hosts[p], key=lambda d: d.id):
      where = tuple(int(i) for i in np.argwhere(mesh.devices == d)[0])
      for name, i in zip(mesh.axis_names, where):
        positions[name].append(i)
      coords = getattr(d, "coords", None)
      entry["devices"].append(
        {
          "id": d.id,
          "coords": list(coords) if coords is not None else None,
          "slice": getattr(d, "slice_index", None),
          "mesh_position": dict(zip(mesh.axis_names, where)),
        }
      )
    entry["mesh_positions"] = {n: _ranges(v) for n, v in positions.items()}
    if layout is not None:
      host = layout.host(p)
      entry["batch_rows"] = [host.rows.start, host.rows.stop]
      entry["row_block"] = host.shard
    out["hosts"].append(entry)
  return out


def format_table(info: dict[str, Any], target: str) -> str:
  lines = [
    f"mesh on {target}: {info['num_devices']} devices ({info['device_kind']}), "
    f"{info['num_hosts']} hosts, {info['num_slices']} slice(s)",
    "axes: " + "  ".join(f"{n}={s}" for n, s in info["axes"].items()),
  ]
  if "global_batch" in info:
    lines.append(
      f"global batch {info['global_batch']} split over {tuple(info['batch_axes'])}: "
      f"data-parallel {info['data_parallel']}, {info['distinct_row_blocks']} distinct "
      f"row blocks of {info['global_batch'] // info['distinct_row_blocks']} rows"
    )
  lines.append("")
  header = f"{'host':>4}  {'devices (id@x,y,z)':<56}  {'mesh positions':<28}"
  if "global_batch" in info:
    header += "  batch rows"
  lines.append(header)
  for h in info["hosts"]:
    devs = " ".join(
      f"{d['id']}@{','.join(map(str, d['coords']))}" if d["coords"] is not None else str(d["id"])
      for d in h["devices"]
    )
    if len(devs) > 56:
      devs = devs[:53] + "..."
    pos = " ".join(f"{n}={r}" for n, r in h["mesh_positions"].items())
    line = f"{h['process']:>4}  {devs:<56}  {pos:<28}"
    if "batch_rows" in h:
      start, stop = h["batch_rows"]
      line += f"  {start}..{stop - 1}"
    lines.append(line)
  return "\n".join(lines)


def _flags(argv: list[str]):
  """Parses `argv` into a fresh flag set (so tests can call `main` repeatedly).

  None when `argv` asks for help, which has then been printed.
  """
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file(
    "config", None, "experiment config file", flag_values=fv, sys_argv=["spmd-mesh", *argv]
  )
  flags.DEFINE_string(
    "mesh",
    None,
    "ICI axes, e.g. data=-1,fsdp=1,tensor=1 (default: the config's mesh.ici, else data=-1)",
    flag_values=fv,
  )
  flags.DEFINE_string("dcn", None, "axes across slices/hosts, e.g. data=2", flag_values=fv)
  flags.DEFINE_string(
    "topology",
    "local",
    "'local' (this machine) or a TPU slice: v4-32, v5e-16, v5p-64, ...",
    flag_values=fv,
  )
  flags.DEFINE_integer("num_slices", 1, "TPU slices", flag_values=fv)
  flags.DEFINE_integer(
    "cpu_devices", None, "with --topology=local: simulate this many CPU devices", flag_values=fv
  )
  flags.DEFINE_integer("global_batch", None, "default: the config's", flag_values=fv)
  flags.DEFINE_string("batch_axes", None, "default: the config's, else data,fsdp", flag_values=fv)
  flags.DEFINE_boolean("json", False, "machine-readable output", flag_values=fv)
  return fv if parse_or_help(fv, "spmd-mesh", argv, __doc__) else None


def main(argv: list[str] | None = None) -> int:
  """`spmd-mesh`: 0, or 2 on a user error (`spmd.errors`)."""
  return errors.run("spmd-mesh", lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
  fv = _flags(argv)
  if fv is None:
    return 0
  config = fv.config
  mesh_cfg = config.mesh if config is not None and "mesh" in config else None
  ici = fv.mesh or (mesh_cfg.ici if mesh_cfg else "data=-1")
  dcn = fv.dcn if fv.dcn is not None else (mesh_cfg.dcn if mesh_cfg else None)
  global_batch = fv.global_batch or (config.get("global_batch") if config else None)
  batch_axes = (
    fv.batch_axes.split(",") if fv.batch_axes else list(mesh_cfg.batch_axes) if mesh_cfg else None
  )
  if fv.topology == "local":
    if fv.cpu_devices:
      jax.config.update("jax_num_cpu_devices", fv.cpu_devices)
    devices = jax.devices()
  else:
    jax.config.update("jax_platforms", "cpu")  # plan only: never look for a real TPU
    with user_input(ValueError):
      devices = list(topology_devices(fv.topology, fv.num_slices))
  try:
    mesh = create_mesh(ici, dcn or None, devices=devices)
    if batch_axes is not None:
      batch_axes = [a for a in batch_axes if a in mesh.shape]
    layout = data_layout(mesh, global_batch, batch_axes) if global_batch else None
  except (ValueError, RuntimeError) as e:
    raise UserError(str(e)) from e
  info = describe(mesh, layout)
  target = fv.topology + (f" x {fv.num_slices} slices" if fv.num_slices > 1 else "")
  print(json.dumps(info, indent=1) if fv.json else format_table(info, target))
  return 0


if __name__ == "__main__":
  sys.exit(main())
