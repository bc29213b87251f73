"""E-M1 and E-M2: Mixtral 8x7B at 4096 tokens on v5p-256, planned: bytes per device ÷ MaxText's, expert FLOPs.

  python -m benchmarks.moe_memory [--json=out.json] [--config=configs/mixtral_8x7b.py]
      [--topology=v5p-256] [--global-batch=N --seq-len=N --num-layers=N]

E-M1 is M1's method (`benchmarks.pod_memory`) for a mixture of experts: both
sides are one field of the compiled program's `memory_analysis()`,
MaxText's "Total memory size" (arguments + outputs - aliased + temporaries,
`MAXTEXT_FIELD`). Ours is that field of the step `spmd-plan` compiles
through libtpu for

  spmd-plan --config=configs/mixtral_8x7b.py --topology=v5p-256

(pure FSDP over the 128 chips, 36 rows of 4096 tokens a chip, full remat,
bf16 compute on float32 parameters and Adam state, splash attention, each
device routing its own rows dropless through `jax.lax.ragged_dot`).
MaxText's side is a constant, `MAXTEXT_BYTES`: MaxText 0.2.5's own
ahead-of-time compile of its `mixtral-8x7b` at the Mixtral setting it
publishes for v5p (`MAXTEXT_COMMAND`; its `benchmarks/maxtext_v5p_model_configs.py`,
`mixtral_8x7b_dropless_v5p_512`: per_device_batch_size 36, ici_fsdp_parallelism
-1, 4096 tokens, remat full, flash attention, megablox with sparse_matmul,
bf16 compute), compiled for v5p-256 rather than v5p-512 and with its
default float32 weights (that setting stores bf16 weights; ours are float32,
and both sides keep the same dtypes here). It needs no expert parallelism.
It is not recomputed here: MaxText stays out of this project's dependencies.
Where libtpu refuses our step (it did on more than one chip while
`trainers.models.moe` routed each batch shard in a `vmap`, which gave each
`ragged_dot` a batch dimension libtpu's grouped matmul does not take), the
row has no value and its detail quotes libtpu.

E-M2 is the expert MLPs' FLOPs the step executes ÷ the active parameters'
MLP FLOPs (tokens x top_k x 3 matmuls x 2 x d_model x d_ff, x3 for the
backward), no remat counted. Compiled FLOPs cannot be taken whole: XLA's
CPU lowering of `ragged_dot` multiplies every row by every group's weight
(its cost analysis reports `groups` times the grouped FLOPs, and that is
what it runs), and libtpu's cost analysis of a train step mixes the
experts with everything else. So the count is per grouped matmul: the
step is traced as the plan compiles it, for the topology's chips, with
`remat_policy=none` (`grouped_matmuls`); inside the routing's shard_map its
grouped matmuls have one chip's shapes. Each `ragged_dot_general` it holds,
at its own shapes and dimension numbers, is compiled alone through libtpu
for one chip of the topology; its cost analysis is what libtpu executes
for it (`executed_flops`). The tight count beside it is 2 x rows x in x
out, the rows being the sum of the group sizes: dropless, every (token,
choice) pair once.

What libtpu does with the kinds: a ragged dot over the rows (the forward,
and the input gradient) is its grouped kernel, at the tight count; the
weight gradient (the rows contracted within each group) XLA's
`ragged_dot_general` lowers as a dense batched matmul of every group's
masked copy of the rows, `groups` times the tight count. For a TPU whose
shapes tile, the step sums the weight gradients with megablox's grouped
kernel instead (`tgmm`, as MaxText does;
`trainers.models.moe.WEIGHT_GRADIENT_KERNEL`), a Pallas kernel whose FLOPs
libtpu's cost analysis does not see. Its count is taken from the group
sizes, 2 x each group's rows x in x out, the tight count (`_tgmm_flops`):
each tile of rows that a group boundary crosses it computes once for each
of its groups, at most a tile of rows more a group, which the row's detail
gives as the figure's upper bound.

The capacity-factor row (E-M2-cf1.25) is computed, not compiled: the
routed MLP here is dropless and has no capacity option. A capacity layout
gives each expert a buffer of `ceil(1.25 x rows / experts)` rows per
routing group, multiplied densely in all three matmuls and their
gradients, so it executes that buffer's rows where dropless executes the
routed ones.

Goals: E-M1 1.0 (as much memory as MaxText needs); E-M2 1.05 dropless.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import jax

jax.config.update("jax_platforms", "cpu")

from jax._src.interpreters import partial_eval as pe  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.pod_memory import (  # noqa: E402
  GIB,
  MAXTEXT_FIELD,
  compiled_plan,
  describe,
  plan_arguments,
)
from spmd import rules as rules_lib  # noqa: E402
from spmd.topology import topology_devices  # noqa: E402
from trainers.models import moe  # noqa: E402
from trainers.step.loss import abstract_batch, batch_shardings  # noqa: E402
from trainers.step.mesh import build_mesh  # noqa: E402
from trainers.step.state import make_state  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import llama as llama_task  # noqa: E402
from trainers.tasks import make_task  # noqa: E402

MAXTEXT_BYTES = 97_590_691_616
"""MaxText 0.2.5's "Total memory size" for Mixtral 8x7B, 4096 tokens, 36 rows a chip, v5p-256.

From its `Memory analysis` line: 4,385,157,120 B of arguments + 4,381,869,856
of outputs - 4,381,863,936 aliased + 93,205,528,576 of temporaries (86.80
GiB), 90.89 GiB in all (of the chip's 95)."""
MAXTEXT_COMMAND = (
  'pip install "maxtext[tpu]==0.2.5"  # in a Python 3.12 venv (jax 0.12.1, libtpu 0.0.52); then:\n'
  # The published setting's scoped-VMEM flag: its 2048-row splash blocks need
  # more than libtpu's default 16 MiB (the compile refuses them without it).
  "LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=81920 "
  "python -m maxtext.trainers.pre_train.train_compile <its maxtext/configs/base.yml> "
  "compile_topology=v5p-256 compile_topology_num_slices=1 model_name=mixtral-8x7b "
  "per_device_batch_size=36 ici_fsdp_parallelism=-1 max_target_length=4096 remat_policy=full "
  "attention=flash megablox=true sparse_matmul=true dtype=bfloat16 weight_dtype=float32 "
  "sa_block_q=2048 sa_block_kv=2048 sa_block_kv_compute=2048 sa_block_q_dkv=2048 "
  "sa_block_kv_dkv=2048 sa_block_kv_dkv_compute=2048 sa_block_q_dq=2048 sa_block_kv_dq=2048 "
  "sa_use_fused_bwd_kernel=true dataset_type=synthetic enable_checkpointing=false "
  "run_name=aot base_output_directory=OUT"
)
"""How `MAXTEXT_BYTES` was measured: it prints `Memory analysis` and "Total memory size"."""
CAPACITY_FACTOR = 1.25


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
  """One `ragged_dot_general` of the traced step, how often it runs, and its FLOPs."""

  count: int  # executions a step (scan lengths multiplied)
  tight_flops: int  # 2 x rows x in x out: each routed row once
  executed_flops: float  # libtpu's cost analysis of it alone; megablox's: the tight count
  ragged_contracting: bool  # the weight gradient's kind: rows contracted within each group
  most_flops: float  # at most what it executes: megablox's tiles at group edges counted too
  megablox: bool = False  # megablox's gmm or tgmm, not XLA's ragged dot


def _inner_jaxprs(params: dict):
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def _is_tgmm(eqn) -> bool:
  """Whether `eqn` is megablox's weight-gradient kernel: its jitted `tgmm`, a Pallas call inside."""
  return eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "tgmm"


def _is_gmm(eqn) -> bool:
  """Whether `eqn` is megablox's kernel for the rows (forward, or their gradient): its `gmm`.

  Differentiation splits the forward's jitted gmm in two; the part that only computes
  its tiles' metadata from the group sizes (no rows in) is not the matmul.
  """
  return (
    eqn.primitive.name in ("jit", "pjit")
    and eqn.params.get("name") == "gmm"
    and len(eqn.invars) >= 3
    and eqn.invars[0].aval.ndim == 2
  )


def _ragged_eqns(jaxpr, times: int = 1):
  """(eqn, executions) of every grouped matmul under `jaxpr` (XLA's ragged_dot_general and
  megablox's gmm and tgmm), scans' lengths multiplied."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "ragged_dot_general" or _is_tgmm(eqn) or _is_gmm(eqn):
      yield eqn, times
      continue
    inner = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
    for sub in _inner_jaxprs(eqn.params):
      yield from _ragged_eqns(sub, inner)


def _tight_flops(eqn) -> tuple[int, bool]:
  """2 x every routed row x its contraction x its output width, and whether rows are contracted."""
  lhs = eqn.invars[0].aval.shape
  numbers = eqn.params["ragged_dot_dimension_numbers"]
  (lhs_contract, _), (lhs_batch, _) = numbers.dot_dimension_numbers
  ragged = numbers.lhs_ragged_dimensions[0]
  contracted = ragged in lhs_contract
  out = math.prod(eqn.outvars[0].aval.shape)
  if contracted:  # [groups, ...] out: each row's product lands in one group's block
    groups = eqn.outvars[0].aval.shape[len(lhs_batch)]
    out //= groups
  contraction = math.prod(lhs[d] for d in lhs_contract)
  return 2 * out * contraction, contracted


def _tgmm_flops(eqn) -> tuple[int, float]:
  """tgmm's FLOPs: 2 x each group's rows x in x out (the group sizes sum to its rows), and at
  most `rows / tm + groups` tiles of `tm` rows visited whole (a tile a group boundary crosses
  once for each of its groups). No compile: libtpu's cost analysis does not see inside a
  Pallas kernel."""
  groups, d_in, d_out = eqn.outvars[0].aval.shape
  rows = eqn.invars[1].aval.shape[0]  # tgmm(x.T [in, rows], the cotangent [rows, out], sizes)
  with moe._kernel("tgmm"):
    tm = moe.weight_gradient_tiling(rows, d_in, d_out, groups)[0]
  return 2 * rows * d_in * d_out, 2.0 * (rows + groups * tm) * d_in * d_out


def _gmm_flops(eqn) -> tuple[int, float]:
  """gmm's FLOPs: 2 x rows x in x out (its rows are the routed ones), and at most `rows / tm +
  groups` tiles of `tm` rows visited whole, as tgmm's (`_tgmm_flops`)."""
  rows, d_in = eqn.invars[0].aval.shape  # gmm(rows [rows, in], w [groups, ...], sizes)
  d_out = eqn.outvars[0].aval.shape[1]
  groups = eqn.invars[1].aval.shape[0]
  with moe._kernel("tgmm", rows="gmm"):
    tm = moe.row_tilings(rows, d_in, d_out, groups)[0][0]
  return 2 * rows * d_in * d_out, 2.0 * (rows + groups * tm) * d_in * d_out


def _libtpu_flops(eqn, device) -> float:
  """libtpu's cost analysis of this one ragged dot, compiled alone for one chip."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding) for v in eqn.invars]
  compiled = jax.jit(lambda *a: eqn.primitive.bind(*a, **eqn.params)).lower(*args).compile()
  return float(compiled.cost_analysis()["flops"])


def grouped_matmuls(config, topology: str) -> list[GroupedMatmul]:
  """One chip's expert matmuls of `config`'s train step for `topology`, with no remat.

  Traced as the plan compiles it, on the topology's chips (the program is
  for a TPU, so it takes the TPU's kernels): each chip routes its own rows
  in a shard_map, whose grouped matmuls have one chip's shapes. Each of
  XLA's is compiled alone for one chip; megablox's are counted (`_tgmm_flops`).
  """
  config = config.copy_and_resolve_references()
  config.model.remat_policy = "none"
  mesh, batch_axes = build_mesh(config, topology_devices(topology))
  task = make_task(config)
  setup = make_state(task.model, config, mesh, batch_axes, task.optimizer)
  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  placement = batch_shardings(task, rules_lib.preset(config.mesh.rules), mesh, batch_axes)
  batch = abstract_batch(task, config.global_batch, placement)
  step = make_train_step(setup, task, config, mesh, batch_axes)
  jaxpr = jax.make_jaxpr(step)(state, batch).jaxpr
  # Dead code out, as XLA takes it out: the custom VJP's backward runs
  # `jax.vjp` for the input gradient, whose primal product nothing reads.
  jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
  chip = topology_devices(topology)[0]
  found, cost = [], {}
  for eqn, times in _ragged_eqns(jaxpr):
    if _is_tgmm(eqn) or _is_gmm(eqn):
      tight, most = (_tgmm_flops if _is_tgmm(eqn) else _gmm_flops)(eqn)
      found.append(GroupedMatmul(times, tight, tight, _is_tgmm(eqn), most, megablox=True))
      continue
    key = (tuple(v.aval for v in eqn.invars), str(eqn.params))
    if key not in cost:
      cost[key] = _libtpu_flops(eqn, chip)
    tight, contracted = _tight_flops(eqn)
    found.append(GroupedMatmul(times, tight, cost[key], contracted, cost[key]))
  return found


def active_mlp_flops(config) -> int:
  """tokens x top_k x 3 matmuls x 2 x d_model x d_ff, x3 for the backward, over every layer."""
  model = llama_task.llama_config(config)
  moe = model.moe_config
  tokens = config.global_batch * model.seq_len
  return 3 * tokens * moe.top_k * 3 * 2 * moe.d_model * moe.d_ff * model.num_layers


def capacity_rows(rows: int, experts: int, factor: float) -> int:
  """Rows a capacity layout multiplies for `rows` routed (token, choice) pairs of one group.

  Example:
    >>> capacity_rows(8 * 4096 * 2, 8, 1.25) / (8 * 4096 * 2)
    1.25
  """
  return experts * math.ceil(factor * rows / experts)


def load_config(args: argparse.Namespace):
  config = common.load_config(args.config)
  for name, value in (("seq_len", args.seq_len), ("num_layers", args.num_layers)):
    if value:
      config.model[name] = value
  if args.global_batch:
    config.global_batch = args.global_batch
  return config


def main() -> None:
  args = plan_arguments(__doc__.splitlines()[0], "configs/mixtral_8x7b.py")
  config = load_config(args)
  chips = len(topology_devices(args.topology))
  name = (
    f"{os.path.basename(args.config)}, {config.global_batch} rows x {config.model.seq_len} "
    f"tokens on {args.topology}, pure FSDP"
  )
  where = common.machine(f"compiled by libtpu for {args.topology}")
  maxtext = MAXTEXT_BYTES
  versus = f"MaxText 0.2.5 {maxtext / GIB:.2f} GiB, both {MAXTEXT_FIELD}"
  what = f"bytes per device, {name} ÷ MaxText's (its own AOT compile, megablox)"
  try:
    ours = compiled_plan(config, args.topology)
  except jax.errors.JaxRuntimeError as e:
    # No figure to give: the row says why, in libtpu's words.
    # libtpu's message: its complaint, then the HLO instruction, then what is wrong.
    message = str(e).splitlines()[0]
    reason = f"{message.split(' from ')[0]} ({message.rsplit(': ', 1)[-1]})"
    print(f"libtpu refused the step: {e}", file=sys.stderr)
    refused = common.row(
      "E-M1", what, 0.0, 1.0, True, f"libtpu refuses our step: {reason}; {versus}", where
    )
    rows = [{**refused, "value": None, "meets_goal": False}]
  else:
    rows = [
      common.row(
        "E-M1",
        what,
        ours.maxtext_field_bytes / maxtext,
        1.0,
        True,
        f"{describe(ours)} vs {versus}",
        where,
      )
    ]
  # One chip's rows: each routes its own (one routing group a batch shard).
  per_chip = config.copy_and_resolve_references()
  per_chip.global_batch = config.global_batch // chips
  matmuls = grouped_matmuls(config, args.topology)
  ideal = active_mlp_flops(per_chip)
  tight = sum(m.count * m.tight_flops for m in matmuls)
  executed = sum(m.count * m.executed_flops for m in matmuls)
  model = llama_task.llama_config(config)
  kernels = sum(m.megablox for m in matmuls)
  weight_kernels = sum(m.megablox and m.ragged_contracting for m in matmuls)
  detail = (
    f"{len(matmuls)} grouped matmuls a step, {kernels} of them megablox's ({weight_kernels} "
    f"tgmm for the weight gradients, {kernels - weight_kernels} gmm for the rows); libtpu's "
    "cost of each of XLA's alone, "
    "megablox's from its group sizes (2 x each group's rows x in x out): "
    f"{executed / 1e12:,.3f} TFLOP a chip vs {ideal / 1e12:,.3f}; the routed rows alone "
    f"(group sizes) {tight / ideal:.3f}"
  )
  if kernels:
    most = sum(m.count * m.most_flops for m in matmuls)
    detail += (
      f"; with megablox's tiles at group edges counted for each group, at most {most / ideal:.3f}"
    )
  dense = sum(
    m.count * m.executed_flops for m in matmuls if m.ragged_contracting and not m.megablox
  )
  if dense:
    detail += (
      f"; the weight gradients XLA's ragged dot lowers densely over the {model.moe_experts} "
      f"experts, {dense / executed:.0%} of it"
    )
  routed = config.global_batch * model.seq_len * model.moe_top_k // chips
  padded = capacity_rows(routed, model.moe_experts, CAPACITY_FACTOR)
  rows += [
    common.row(
      "E-M2",
      f"expert MLP FLOPs the step executes ÷ the active parameters' MLP FLOPs, {name}, "
      "dropless, no remat",
      executed / ideal,
      1.05,
      True,
      detail,
      where,
    ),
    common.row(
      "E-M2-cf1.25",
      f"E-M2 for a capacity factor of {CAPACITY_FACTOR} (computed: the routed MLP is dropless)",
      padded / routed,
      None,
      True,
      f"{routed:,} routed rows a chip padded to {padded:,} in {model.moe_experts} expert "
      f"buffers: {padded / routed - 1:.0%} more expert FLOPs than dropless's tight count, "
      "and tokens over an expert's buffer dropped",
      "computed from the shapes",
    ),
  ]
  common.emit(rows, args.json)


if __name__ == "__main__":
  main()
